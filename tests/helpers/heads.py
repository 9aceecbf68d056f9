"""Random EAGLE-3 heads over a tiny target."""

from __future__ import annotations

from tsengine.eagle3.config import Eagle3Config
from tsengine.eagle3.head import Eagle3Head
from tsengine.eagle3.vocab import vocab_map


def random_head(model, seed: int = 0, draft_vocab_size: int | None = None, counts=None) -> Eagle3Head:
    cfg = Eagle3Config.for_target(model.config, draft_vocab_size=draft_vocab_size)
    head = Eagle3Head(cfg)
    head.init_weights(seed)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, counts))
    head.bind_embeddings(model.get_input_embeddings().weight)
    return head.eval()
