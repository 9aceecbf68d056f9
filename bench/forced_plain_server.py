"""`tsengine serve` whose adaptive policy always answers plain decoding: every step pays the adaptive
machinery (prompt lookup, the head's kept features, its catch-ups, the prefix cache's rules for the head)
and decodes plainly. bench/serve_throughput.py starts it for its `--forced-plain` row, beside a plain
server: the gap between the two is what adaptive speculation costs where it decides to decode plainly.

    python bench/forced_plain_server.py serve --model M --speculative-algorithm EAGLE3 ... (tsengine serve's flags)
"""

from __future__ import annotations

import sys

from tsengine.entrypoints.cli import main
from tsengine.speculative.adaptive.plan import Arm, Plan
from tsengine.speculative.adaptive.policy import AdaptivePolicy


def plain(self, stats, *_args, **_kw) -> Plan:
    return Plan(Arm(0), ["plain"] * len(stats))


if __name__ == "__main__":
    AdaptivePolicy.choose = plain
    sys.exit(main(sys.argv[1:]))
