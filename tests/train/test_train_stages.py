"""Each training stage alone: recipe validation, regeneration resume, the vocab cache key, the feature
dump (two ranks, resume, checksums), export refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.data import write_rows
from tsengine.errors import UserError
from tsengine.train import recipe as recipes
from tsengine.train.dump_features import dump, finalize
from tsengine.train.features import FeatureStore, TargetFeatures
from tsengine.train.prepare_data import load_prepared, prepare
from tsengine.train.regenerate import Regenerator, read_done
from tsengine.train.vocab import build_vocab, load_vocab

REPO = Path(__file__).resolve().parents[2]


# ---- recipes ------------------------------------------------------------------------------------
def test_unknown_key_and_range_are_named(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("target: x\ntrain:\n  ttt_step: 3\n  lr: 2.0\n")
    with pytest.raises(UserError) as e:
        recipes.load(p)
    msg = str(e.value)
    assert "train.ttt_step: unknown key" in msg and "train.lr=2.0" in msg and "<= 1.0" in msg


def test_overrides_are_validated_like_the_file(tmp_path):
    r = recipes.load(None, ["target=x", "train.ttt_steps=5", "eval.tree=null", "head.aux_layer_ids=[1,2,3]"])
    assert r.train.ttt_steps == 5 and r.eval.tree is None and r.head.aux_layer_ids == (1, 2, 3)
    with pytest.raises(UserError, match=r"train.ttt_steps=0.*>= 1 and <= 16"):
        recipes.load(None, ["target=x", "train.ttt_steps=0"])
    with pytest.raises(UserError, match="target: required"):
        recipes.load(None, [])


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_validate(name):
    recipes.load(REPO / "recipes" / f"{name}.yaml")


@pytest.mark.parametrize("name,params", [("llama3.1-8b-instruct", 424_689_664), ("qwen3-8b", 399_523_840)])
def test_gpu_recipes_dry_run(name, params):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "train/train_eagle3.py", "--recipe", f"recipes/{name}.yaml", "--dry-run"],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout[r.stdout.index("{"):])
    assert info["head"]["trainable_params"] == params and info["head"]["draft_vocab_size"] == 32000


def test_bad_recipe_exits_2_without_traceback(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("target: x\nfeatures: {mode: sideways}\n")
    r = subprocess.run([sys.executable, "train/train_eagle3.py", "--recipe", str(p)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "features.mode" in r.stderr and "Traceback" not in r.stderr


def test_overrides_may_sit_between_flags(tmp_path):
    """`key=value` overrides before and after a flag are all applied (and all validated): the benchmarks and
    users write `--max-samples N key=value` after other overrides."""
    p = tmp_path / "r.yaml"
    p.write_text("target: x\n")
    r = subprocess.run([sys.executable, "train/train_eagle3.py", "--recipe", str(p), "train.lr=7",
                        "--max-samples", "3", "eval.num_prompts=0"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "train.lr" in r.stderr and "eval.num_prompts" in r.stderr, r.stderr[-2000:]


# ---- regeneration -------------------------------------------------------------------------------
def test_regeneration_is_greedy_batched_and_resumes(tiny_models, tmp_path):
    model, tok = tiny_models["llama"]
    rows = [json.loads(x) for x in write_rows(tmp_path / "p.jsonl", 7, 3, with_answers=False).read_text().splitlines()]
    rows.append({"id": "bad", "messages": [{"role": "user", "content": ""}]})
    out = tmp_path / "regen.jsonl"
    regen = Regenerator(model, tok, batch_size=3, max_new_tokens=10)
    skipped = regen.run(rows[:4], out, progress=False)
    assert len(read_done(out)) == 4 and not skipped.reasons
    with out.open("a") as f:
        f.write('{"id": "torn", "mess')  # killed mid-write
    skipped = regen.run(rows, out, progress=False)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(r["id"] for r in rows[:7])  # no duplicates, torn line gone
    assert skipped.reasons == {"empty content": 1}
    # a batched, left-padded answer equals the unbatched greedy continuation
    r0 = next(r for r in lines if r["id"] == rows[0]["id"])
    text = tok.apply_chat_template(rows[0]["messages"], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    alone = model.generate(**ids, max_new_tokens=10, do_sample=False, pad_token_id=regen.pad, eos_token_id=regen.eos)
    new = alone[0, ids["input_ids"].shape[1]:].tolist()
    stop = next((i for i, t in enumerate(new) if t in regen.eos), len(new))
    assert r0["messages"][-1]["content"] == tok.decode(new[:stop], skip_special_tokens=True).strip()


# ---- vocab --------------------------------------------------------------------------------------
def _chat(path: Path, n: int, seed: int) -> Path:
    return write_rows(path, n, seed, with_answers=True)


def test_vocab_counts_assistant_tokens_and_keys_on_inputs(tiny_models, tmp_path):
    model, tok = tiny_models["llama"]
    v = model.config.vocab_size
    a = prepare(tok, _chat(tmp_path / "a.jsonl", 20, 0), tmp_path / "prep-a", 128, quiet=True)
    b = prepare(tok, _chat(tmp_path / "b.jsonl", 20, 1), tmp_path / "prep-b", 128, quiet=True)
    va = build_vocab(tok, a, v, 64, tmp_path / "vocab", quiet=True)
    assert build_vocab(tok, a, v, 64, tmp_path / "vocab", quiet=True) == va  # cached
    assert build_vocab(tok, b, v, 64, tmp_path / "vocab", quiet=True) != va  # other data: other key
    assert build_vocab(tok, a, v, 32, tmp_path / "vocab", quiet=True) != va  # other N: other key
    d2t, t2d = load_vocab(va)
    counts = torch.zeros(v)
    for row in load_prepared(a):
        for t, m in zip(row["input_ids"], row["loss_mask"]):
            counts[t] += m
    top = set(torch.sort(-counts, stable=True).indices[:64].tolist())
    assert set((torch.arange(64) + d2t).tolist()) == top and int(t2d.sum()) == 64


def test_tokenizer_digest_ignores_padding_state(tiny_models):
    from tsengine.train.stages import tokenizer_digest

    _, tok = tiny_models["llama"]
    tok = type(tok).from_pretrained(tok.name_or_path)
    before = tokenizer_digest(tok)
    tok.padding_side = "left"
    tok(["the water", "one"], padding=True)  # regeneration does this; the prepared data must not go stale
    assert tokenizer_digest(tok) == before
    tok.chat_template = "{{ messages[0].content }}"
    assert tokenizer_digest(tok) != before


def test_small_user_data_still_gets_a_validation_row(tmp_path):
    from tsengine.train.splits import source_splits as _source_splits

    src = write_rows(tmp_path / "three.jsonl", 3, 9, with_answers=True)
    r = recipes.load(None, ["target=x", f"data.source={src}"])
    train, val = _source_splits(r, tmp_path)
    assert len(val) >= 1 and len(train) + len(val) == 3 and not {x["id"] for x in train} & {x["id"] for x in val}
    one = write_rows(tmp_path / "one.jsonl", 1, 9, with_answers=True)
    with pytest.raises(UserError, match="cannot be split"):
        _source_splits(recipes.load(None, ["target=x", f"data.source={one}"]), tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty"):
        _source_splits(recipes.load(None, ["target=x", f"data.source={tmp_path / 'empty.jsonl'}"]), tmp_path)


# ---- offline features ---------------------------------------------------------------------------
def test_dump_two_ranks_resume_and_checksum(tiny_models, tmp_path):
    model, tok = tiny_models["qwen3"]
    prep = prepare(tok, _chat(tmp_path / "c.jsonl", 9, 2), tmp_path / "prep", 128, quiet=True)
    data, out, ids = load_prepared(prep), tmp_path / "feat", (1, 3, 5)
    for rank in (0, 1):
        dump(model, data, ids, out, "k1", batch_tokens=100, shard_tokens=60, rank=rank, world=2, progress=False)
    index = finalize(out, "k1", len(data), {})
    assert len(index["shards"]) >= 2 and {f for s in index["shards"] for f in s["examples"]} == set(range(9))
    # resume: drop one finished shard, dump again, only its examples are redone
    victim = index["shards"][0]
    (out / victim["file"]).unlink()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    for rank in (0, 1):
        dump(model, data, ids, out, "k1", batch_tokens=100, shard_tokens=60, rank=rank, world=2, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.safetensors")}
    assert all(after[n] == t for n, t in before.items())
    finalize(out, "k1", len(data), {})
    store = FeatureStore(out)
    feats = TargetFeatures(model, ids)
    row = torch.tensor([data[4]["input_ids"]])
    online = feats(row, torch.ones_like(row))
    aux, final, arg = store.get(4)
    torch.testing.assert_close(aux, online.aux[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, online.final[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(arg.long(), online.argmax[0])
    # a flipped byte is caught by the checksum, naming the shard
    shard = out / store.where[4][0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=store.where[4][0]):
        FeatureStore(out).get(4)


# ---- export -------------------------------------------------------------------------------------
def test_export_refuses_incomplete_or_mismatched_checkpoints(tiny_dirs, tiny_models, tmp_path):
    from safetensors.torch import save_file

    from tests.helpers.heads import random_head
    from tsengine.eagle3.export import export_checkpoint

    model, _ = tiny_models["llama"]
    head = random_head(model, seed=1, draft_vocab_size=100)
    ck = tmp_path / "checkpoints" / "step-00000003"
    ck.mkdir(parents=True)
    (ck / "head_config.json").write_text(json.dumps(head.config.to_hf_dict()))
    sd = {k: v.contiguous() for k, v in head.exported_state_dict().items()}
    save_file(sd, str(ck / "head.safetensors"))
    with pytest.raises(UserError, match="the run has no complete checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(UserError, match="incomplete: missing COMPLETE"):
        export_checkpoint(ck, tmp_path / "out")
    (ck / "COMPLETE").write_text("")
    export_checkpoint(tmp_path, tmp_path / "out", target=model.config)  # the run dir -> its latest checkpoint
    sd["lm_head.weight"] = sd["lm_head.weight"][:50]
    save_file(sd, str(ck / "head.safetensors"))
    with pytest.raises(UserError, match=r"lm_head.weight has shape \[50, 64\]"):
        export_checkpoint(ck, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    r = subprocess.run([sys.executable, "-m", "tsengine.entrypoints.cli", "export", str(ck),
                        "--out", str(tmp_path / "o3")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "lm_head.weight" in r.stderr and "Traceback" not in r.stderr
