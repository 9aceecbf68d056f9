"""bench/specforge_ab.py's pure conversions (our features, vocab and target -> SpecForge's inputs); no SpecForge
needed: the benchmark itself runs SpecForge in its own venv."""

from __future__ import annotations

import json

import pytest
import torch

from bench.specforge_ab import (
    from_specforge_sample,
    index_json,
    specforge_config,
    step_seconds,
    to_specforge_sample,
    vocab_mapping,
)
from tsengine.eagle3.vocab import vocab_map


def _row(n: int, h: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (n,), generator=g).tolist()
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    return ids, mask, torch.randn(n - 1, 3 * h, generator=g), torch.randn(n - 1, h, generator=g)


def test_sample_has_specforges_offline_layout(tmp_path):
    ids, mask, aux, final = _row(12)
    rec = to_specforge_sample(ids, mask, aux, final)
    assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert rec["input_ids"].shape == rec["loss_mask"].shape == (11,)  # cut to the captured positions
    assert rec["hidden_state"].shape == (1, 11, 8) and rec["hidden_state"].dtype == torch.bfloat16
    assert rec["aux_hidden_state"].shape == (1, 11, 24) and rec["aux_hidden_state"].dtype == torch.float32
    torch.save(rec, tmp_path / "row.ckpt")  # the file SpecForge reads back with torch.load
    back = torch.load(tmp_path / "row.ckpt", weights_only=False)
    ids2, mask2, aux2, final2 = from_specforge_sample(back)
    assert ids2 == ids[:11] and mask2 == mask[:11]
    assert torch.equal(aux2, aux)
    assert torch.equal(final2, final.to(torch.bfloat16).float())


def test_sample_owns_its_storage():
    """A row read from a shard is a view of the whole shard; the record must not drag the shard along."""
    ids, mask, aux, final = _row(12)
    shard_aux, shard_final = torch.cat([aux, aux, aux]), torch.cat([final, final, final])
    rec = to_specforge_sample(ids, mask, shard_aux[11:22], shard_final[11:22])
    for key in ("hidden_state", "aux_hidden_state"):
        t = rec[key]
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_sample_of_equal_lengths_is_kept_whole_and_a_mismatch_refused():
    ids, mask, aux, final = _row(6)
    rec = to_specforge_sample(ids[:5], mask[:5], aux, final)
    assert rec["input_ids"].tolist() == ids[:5]
    with pytest.raises(ValueError, match="lengths disagree"):
        to_specforge_sample(ids[:4], mask[:4], aux, final)


def test_vocab_mapping_is_our_d2t_t2d():
    counts = torch.tensor([0, 5, 1, 9, 0, 3, 7, 2], dtype=torch.float64)
    d2t, t2d = vocab_map(8, 4, counts)
    m = vocab_mapping(d2t, t2d)
    assert m["d2t"].dtype == torch.int64 and m["t2d"].dtype == torch.bool
    assert (torch.arange(4) + m["d2t"]).tolist() == t2d.nonzero().flatten().tolist() == [1, 3, 5, 6]


def test_index_json_maps_every_key_to_the_one_file():
    idx = index_json(["model.embed_tokens.weight", "model.norm.weight"])
    assert idx["weight_map"] == {"model.embed_tokens.weight": "model.safetensors",
                                 "model.norm.weight": "model.safetensors"}
    json.dumps(idx)


def test_config_is_offline_one_process_and_overrides_only_what_is_given():
    kw = dict(target="/t", draft_config="/d.json", vocab="/v.pt", data="/data", out="/o", max_length=512,
              aux_layers=(1, 14, 26), epochs=2, lm_head_key="model.embed_tokens.weight", seed=0)
    cfg = specforge_config(**kw)
    assert cfg["data"]["hidden_states_path"] == "/data" and "train_data_path" not in cfg["data"]
    assert cfg["training"]["fsdp_sharding"] == "NO_SHARD" and cfg["training"]["attention_backend"] == "sdpa"
    assert cfg["model"]["aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert not {"learning_rate", "ttt_length", "warmup_ratio", "max_steps"} & set(cfg["training"])
    ours = specforge_config(**kw, lr=1e-3, warmup=0.03, ttt=5, max_steps=7)["training"]
    assert (ours["learning_rate"], ours["warmup_ratio"], ours["ttt_length"], ours["max_steps"]) == (1e-3, 0.03, 5, 7)


def test_step_seconds_sums_specforges_per_step_times():
    log = ("warning line\nstep 1: {'loss': 4.2, 'perf/optimizer_step_time_s': 1.25}\n"
           "step 2: {'loss': 4.1, 'perf/optimizer_step_time_s': 0.5}\nSPECFORGE_STATE {}\n")
    assert step_seconds(log) == 1.8
    assert step_seconds("no steps") is None
