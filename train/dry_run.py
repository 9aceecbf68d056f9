"""`--dry-run`: validate a recipe without a GPU or the hub, so a GPU recipe is checked on a laptop before
it is queued."""

from __future__ import annotations

import json
from pathlib import Path

from tsengine.errors import UserError


def dry(r, plan: list[str]) -> dict:
    """Schema (already), accelerate/DeepSpeed files, the head's shape for the target (from the hub, or
    from recipes/targets/<org>--<name>.json offline), and `plan`: the stages this recipe would run."""
    import yaml
    from transformers import AutoConfig

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.targets import resolve

    info: dict = {"recipe": "ok"}
    repo = Path(__file__).resolve().parent.parent / "recipes"
    for f in sorted((repo / "accelerate").glob("*.yaml")):
        yaml.safe_load(f.read_text())
    for f in sorted((repo / "deepspeed").glob("*.json")):
        json.loads(f.read_text())
    info["launch_configs"] = "ok"
    try:
        tc, origin = AutoConfig.from_pretrained(resolve(r.target)), "target"
    except (OSError, ValueError):
        snap = repo / "targets" / (r.target.replace("/", "--") + ".json")
        if not snap.exists():
            raise UserError(f"target {r.target}: config not reachable and no {snap} snapshot") from None
        raw = json.loads(snap.read_text())
        tc, origin = AutoConfig.for_model(raw.pop("model_type"), **raw), f"snapshot {snap.name}"
    cfg = Eagle3Config.for_target(tc, draft_vocab_size=r.vocab.draft_vocab_size, aux_layer_ids=r.head.aux_layer_ids)
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i < tc.num_hidden_layers]
    if bad:
        raise UserError(f"head.aux_layer_ids {list(cfg.aux_layer_ids)}: {bad} outside 0..{tc.num_hidden_layers - 1}")
    if r.vocab.draft_vocab_size > tc.vocab_size:
        raise UserError(f"vocab.draft_vocab_size {r.vocab.draft_vocab_size} exceeds the target vocab {tc.vocab_size}")
    counts = _param_counts(cfg)
    info["head"] = {"config_from": origin, "trainable_params": sum(counts.values()),
                    "aux_layer_ids": list(cfg.aux_layer_ids), "draft_vocab_size": cfg.draft_vocab_size,
                    "rope": cfg.rope_parameters.get("rope_type", "default")}
    bpt = {"float32": 4, "bfloat16": 2, "float16": 2}[r.features.dtype] * 4 * tc.hidden_size + 4
    info["offline_feature_bytes_per_token"] = bpt
    info["stages"] = plan
    print(json.dumps(info, indent=1))
    return info


def _param_counts(cfg) -> dict[str, int]:
    from tsengine.eagle3.format import expected_shapes, head_keys

    out = {}
    for k, shape in expected_shapes(cfg).items():
        if k in ("d2t", "t2d") or k not in head_keys(cfg):
            continue
        n = 1
        for d in shape:
            n *= d
        out[k] = n
    return out
