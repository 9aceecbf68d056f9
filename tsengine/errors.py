"""User-facing errors.

A `UserError` is a mistake in what the user handed us (a path, a flag, a file). The CLI prints it as one
message and exits non-zero; it never becomes a traceback. Everything else is a bug and keeps its trace.
"""

import sys
from typing import Callable


class UserError(Exception):
    """Bad input, described in words that name the file or field and what was expected."""


def fail_if(problems: list[str], what: str) -> None:
    """Raise one error listing every problem, so a user fixes them all in one go."""
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise UserError(f"{what}:\n{lines}")


def run_main(prog: str, body: Callable[[], None]) -> int:
    """Every command's last line: a UserError becomes `prog: error: ...` on stderr and exit code 2."""
    try:
        body()
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
