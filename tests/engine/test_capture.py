"""Features captured while the engine regenerates (tsengine/engine/capture.py, train/regen_engine.py, train/capture.py).

The invariants: captured rows equal a teacher-forced forward over the finished sequence; the stored ids
are the ids the engine ran; capture changes no answer (greedy = plain engine greedy, sampled = the same
draws whatever the batch); a resumed capture equals an uninterrupted one; training from captured features
equals training from dumped features on the same rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from tsengine.train.data import captured_example
from tsengine.train.features import FeatureStore, ShardWriter, TargetFeatures
from tsengine.train.regen_engine import EngineRegenerator
from tsengine.train.regenerate import answer_rows

LAYERS = (1, 3, 5)
WORDS = "the water one number how long two people call first who may down side been now find".split()


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(
        rng.randint(3, 40)))}]} for i in range(n)]
    # one multi-turn row: the earlier reply is regenerated too, the last one is captured
    rows.append({"id": "multi", "messages": [{"role": "user", "content": "the water"},
                                            {"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "how long two people"}]})
    return rows


def capture(target: Path, tok, rows, out: Path, max_num_seqs: int = 4, chunk: int | None = None, seed: int = 0,
            max_new_tokens: int = 24, **engine_args):
    """`chunk`: a small prefill budget, so prompts are forwarded in several chunks."""
    writer = ShardWriter(out, "k", "shard", "float32", 256)
    regen = EngineRegenerator(str(target), tok, max_num_seqs, max_new_tokens, 1.0, seed, 256, LAYERS,
                              **({"max_num_batched_tokens": chunk} if chunk else {}), **engine_args)
    skipped = regen.run(rows, writer=writer, progress=False)
    return writer.existing(), skipped


def examples(out: Path, shards) -> dict[str, dict]:
    """id -> {ids, mask, messages, aux, final, argmax} read back from the shards."""
    found = {}
    for m in shards:
        t = load_file(str(out / m["file"]))
        for i, rid in enumerate(m["examples"]):
            o, n = m["offsets"][i], m["lengths"][i]
            found[rid] = {"ids": m["input_ids"][i], "mask": m["loss_mask"][i], "messages": m["messages"][i],
                          "aux": t["aux"][o:o + n], "final": t["final"][o:o + n], "argmax": t["argmax"][o:o + n].long()}
    return found


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_captured_features_equal_a_teacher_forced_forward(kind, tiny_dirs, tiny_models, tmp_path):
    model, tok = tiny_models[kind]
    rows = answer_rows(prompt_rows(10), 0.8, samples=2, include_greedy=True)
    shards, skipped = capture(tiny_dirs[kind], tok, rows, tmp_path, chunk=16)
    got = examples(tmp_path, shards)
    assert len(got) + sum(skipped.reasons.values()) == len(rows)
    assert len(got) >= len(rows) // 2, skipped.summary(len(got))
    multi = [k for k in got if k.startswith("multi")]
    assert multi, skipped.summary(len(got))
    assert all(got[k]["messages"][1]["content"] != "x" for k in multi)
    feats = TargetFeatures(model, LAYERS)
    for rid, ex in got.items():
        ids = torch.tensor([ex["ids"]])
        f = feats(ids, torch.ones_like(ids))
        n = len(ex["ids"]) - 1  # the last token (stop or length) is sampled, never forwarded
        assert ex["aux"].shape[0] == n
        torch.testing.assert_close(ex["aux"], f.aux[0, :n], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(ex["final"], f.final[0, :n], atol=1e-3, rtol=1e-3)
        logits = f.final[0, :n] @ model.get_output_embeddings().weight.t()
        top2 = logits.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 1e-3  # a near-tie may flip between two fp32 kernels
        assert (ex["argmax"] == f.argmax[0, :n])[decisive].all()
        # the mask comes from the template: the answer (and its end-of-turn) is trained on, the prompt not
        assert len(ex["mask"]) == len(ex["ids"]) and ex["mask"][-1] == 1
        if not rid.startswith("multi"):
            prompt = tok.apply_chat_template(ex["messages"][:-1], tokenize=False, add_generation_prompt=True)
            k = len(tok(prompt, add_special_tokens=False)["input_ids"])
            assert ex["ids"][:k] == tok(prompt, add_special_tokens=False)["input_ids"]
            assert ex["mask"] == [0] * k + [1] * (len(ex["ids"]) - k)


def test_capture_survives_preemption_and_one_token_answers(tiny_dirs, tiny_models, tmp_path):
    """Too few KV blocks for the batch: requests are preempted and recomputed, overwriting the positions
    they had captured; the features equal an unpressured run's. And a request that ends with its first
    sampled token (max_tokens 1) has exactly its prompt's rows."""
    from tsengine.engine.scheduler import Scheduler

    _, tok = tiny_models["llama"]
    rows = answer_rows(prompt_rows(6)[:-1], 0.8, samples=1, include_greedy=True)
    calm = examples(tmp_path / "calm", capture(tiny_dirs["llama"], tok, rows, tmp_path / "calm", block_size=4)[0])
    preempted, original = [], Scheduler._preempt

    def counting(self, seq):
        preempted.append(seq.request_id)
        original(self, seq)

    Scheduler._preempt = counting
    try:
        got = examples(tmp_path / "tight", capture(tiny_dirs["llama"], tok, rows, tmp_path / "tight", block_size=4,
                                                  num_kv_blocks=64, debug_checks=True)[0])
    finally:
        Scheduler._preempt = original
    assert preempted, "the KV budget did not force a preemption"
    assert got.keys() == calm.keys()
    for rid in calm:
        assert got[rid]["ids"] == calm[rid]["ids"]
        torch.testing.assert_close(got[rid]["aux"], calm[rid]["aux"], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(got[rid]["final"], calm[rid]["final"], atol=1e-3, rtol=1e-3)
    one = examples(tmp_path / "one", capture(tiny_dirs["llama"], tok, rows, tmp_path / "one", max_new_tokens=1)[0])
    both = one.keys() & calm.keys()
    assert both
    for rid in both:
        ex = one[rid]
        assert ex["aux"].shape[0] == len(ex["ids"]) - 1 and ex["mask"].count(1) == 1
        torch.testing.assert_close(ex["aux"], calm[rid]["aux"][:len(ex["ids"]) - 1], atol=1e-3, rtol=1e-3)


def test_capture_changes_no_answer(tiny_dirs, tiny_models, tmp_path):
    """Greedy answers equal the plain engine's greedy; sampled answers are the same draws whatever the
    batch size and chunking (keyed by regen.seed and the row id)."""
    from tsengine.entrypoints.llm import LLM
    from tsengine.sampling_params import SamplingParams

    model, tok = tiny_models["llama"]
    rows = answer_rows(prompt_rows(6)[:-1], 0.9, samples=2, include_greedy=True)
    a = examples(tmp_path / "a", capture(tiny_dirs["llama"], tok, rows, tmp_path / "a", max_num_seqs=8)[0])
    b = examples(tmp_path / "b", capture(tiny_dirs["llama"], tok, rows, tmp_path / "b", max_num_seqs=2, chunk=8)[0])
    assert a.keys() == b.keys() and len(a) > 0
    for rid in a:
        assert a[rid]["ids"] == b[rid]["ids"], rid
    llm = LLM(str(tiny_dirs["llama"]))
    greedy = [r for r in rows if r["temperature"] == 0 and r["id"] in a]
    assert greedy
    for r in greedy:
        prompt = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].token_ids
        assert a[r["id"]]["ids"] == ids + out
    other = examples(tmp_path / "c", capture(tiny_dirs["llama"], tok, rows, tmp_path / "c", seed=1)[0])
    assert any(other[k]["ids"] != a[k]["ids"] for k in a if "~s" in k and k in other), "regen.seed is not used"


def test_resumed_capture_equals_an_uninterrupted_one(tiny_dirs, tiny_models, tmp_path):
    _, tok = tiny_models["llama"]
    rows = answer_rows(prompt_rows(8)[:-1], 0.8, samples=1, include_greedy=True)
    whole = examples(tmp_path / "whole", capture(tiny_dirs["llama"], tok, rows, tmp_path / "whole")[0])
    capture(tiny_dirs["llama"], tok, rows[:5], tmp_path / "parts")  # the run killed after 5 rows
    (tmp_path / "parts" / "shard-99999.json").write_text("{torn")  # and a torn sidecar, ignored and removed
    shards, _ = capture(tiny_dirs["llama"], tok, rows, tmp_path / "parts")
    parts = examples(tmp_path / "parts", shards)
    assert not (tmp_path / "parts" / "shard-99999.json").exists()
    assert parts.keys() == whole.keys()
    assert sum(len(m["examples"]) for m in shards) == len(parts), "a resumed run redid finished rows"
    for rid in whole:
        assert parts[rid]["ids"] == whole[rid]["ids"] and parts[rid]["mask"] == whole[rid]["mask"]
        torch.testing.assert_close(parts[rid]["aux"], whole[rid]["aux"], atol=1e-3, rtol=1e-3)


def test_captured_example_refuses_a_template_that_rewrites_the_reply(tiny_models):
    """A template that trims the reply cannot be aligned with ids that decode to leading spaces."""
    import copy

    _, tok = tiny_models["llama"]
    trimming = copy.deepcopy(tok)
    trimming.chat_template = tok.chat_template.replace("message['content']", "message['content'] | trim")
    msgs = [{"role": "user", "content": "the water"}, {"role": "assistant", "content": "  one number"}]
    prompt = tok(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    answer = tok("  one number<|im_end|>", add_special_tokens=False)["input_ids"]
    ex = captured_example(tok, msgs, prompt, answer)
    assert ex.input_ids == prompt + answer and sum(ex.loss_mask) == len(answer)
    with pytest.raises(ValueError, match="differs from the template"):
        captured_example(trimming, msgs, prompt, answer)
    with pytest.raises(ValueError, match="over max length"):
        captured_example(tok, msgs, prompt, answer, max_length=len(prompt))


def test_training_from_captured_equals_training_from_dumped(tiny_dirs, tiny_models, tmp_path):
    """The same prepared rows, features captured vs dumped by a second pass: the TTT loss and its
    gradient agree (the captured store has no row for the last token, which no loss term reads)."""
    from tests.helpers.heads import random_head
    from tsengine.train import dump_features
    from tsengine.train.batching import collate
    from tsengine.train.capture import _finalize
    from tsengine.train.prepare_data import load_prepared
    from tsengine.train.trainer import TTTModel

    model, tok = tiny_models["llama"]
    rows = answer_rows(prompt_rows(6)[:-1], 0.0)
    cap = tmp_path / "capture"
    shards, _ = capture(tiny_dirs["llama"], tok, rows, cap)
    prepared, store_dir = _finalize(cap, shards, [r["id"] for r in rows], tmp_path, "train", "k")
    data = load_prepared(prepared)
    dumped = tmp_path / "dumped"
    dump_features.dump(model, data, LAYERS, dumped, "d", progress=False)
    dump_features.finalize(dumped, "d", len(data), {})
    captured, full = FeatureStore(store_dir), FeatureStore(dumped)
    head = random_head(model, draft_vocab_size=200).train()
    rows_w = model.get_output_embeddings().weight[head.d2t + torch.arange(head.config.draft_vocab_size)]
    ttt = TTTModel(head, model.get_input_embeddings().weight, rows_w, steps=3, decay=0.8, chunk=64)
    batch = list(range(len(data)))
    ids, att, mask = collate(data, batch, "cpu")
    losses, grads = [], []
    for store in (captured, full):
        f = store.batch(batch, ids.shape[1], torch.float32)
        head.zero_grad()
        loss, stats = ttt(ids, mask, f.aux, f.final, f.argmax)
        loss.backward()
        losses.append((loss.detach(), stats))
        grads.append(head.fc.weight.grad.clone())
    assert losses[0][1][:, 1].sum() > 0, "no position was scored"
    torch.testing.assert_close(losses[0][0], losses[1][0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(losses[0][1], losses[1][1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-3)
    index = json.loads((store_dir / "index.json").read_text())
    assert index["tokens"] == sum(len(x) - 1 for x in data["input_ids"])


def test_engine_regeneration_resumes_and_matches_hf(tiny_models, tiny_dirs, tmp_path):
    """Without capture the engine backend writes the same JSONL as the HF one: resumable by id, a torn
    line dropped, bad rows counted, and the same greedy answers."""
    from tsengine.train.regenerate import Regenerator, read_done

    model, tok = tiny_models["llama"]
    rows = prompt_rows(7)[:-1]
    rows.append({"id": "bad", "messages": [{"role": "user", "content": ""}]})
    out = tmp_path / "regen.jsonl"
    regen = EngineRegenerator(str(tiny_dirs["llama"]), tok, 3, 10)
    assert not regen.run(rows[:4], out, progress=False).reasons and len(read_done(out)) == 4
    with out.open("a") as f:
        f.write('{"id": "torn", "mess')  # killed mid-write
    skipped = regen.run(rows, out, progress=False)
    lines = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(lines) == sorted(r["id"] for r in rows[:7]) and skipped.reasons == {"empty content": 1}
    hf = tmp_path / "hf.jsonl"
    Regenerator(model, tok, batch_size=1, max_new_tokens=10).run(rows[:7], hf, progress=False)
    same = sum(lines[r["id"]]["messages"] == r["messages"] for r in map(json.loads, hf.read_text().splitlines()))
    assert same >= 6, f"only {same}/7 greedy answers equal HF's"  # a near-tie may flip one (fp32 kernels)


def test_answer_rows_and_their_recipe_rules(tmp_path):
    from tsengine.errors import UserError
    from tsengine.train.recipe import validate

    rows = [{"id": "a", "messages": []}, {"id": "b", "messages": []}]
    assert [(r["id"], r["temperature"]) for r in answer_rows(rows, 0.0)] == [("a", 0.0), ("b", 0.0)]
    got = [(r["id"], r["temperature"]) for r in answer_rows(rows, 0.7, samples=2, include_greedy=True)]
    assert got == [("a", 0.0), ("a~s0", 0.7), ("a~s1", 0.7), ("b", 0.0), ("b~s0", 0.7), ("b~s1", 0.7)]
    with pytest.raises(UserError, match="samples_per_prompt=3 needs regen.temperature > 0"):
        validate({"target": "x", "regen": {"samples_per_prompt": 3}})
    with pytest.raises(UserError, match="include_greedy needs regen.temperature > 0"):
        validate({"target": "x", "regen": {"include_greedy": True}})
    with pytest.raises(UserError, match="regen.backend"):
        validate({"target": "x", "regen": {"backend": "vllm"}})


def test_capture_key_follows_what_decides_a_row(tiny_models, monkeypatch):
    """Target-written prompts: their count may change without redoing the captured rows (a row's text
    depends on its id and the generator's version), a new generator version redoes them; the answers'
    settings count, the engine's batch size does not."""
    from tsengine.train import capture
    from tsengine.train.prompts import synthetic
    from tsengine.train.recipe import load

    _, tok = tiny_models["llama"]

    def key(*over):
        return capture._key(load(None, ["target=x", *over]), tok, LAYERS)

    assert key("data.synthetic_prompts=8") == key("data.synthetic_prompts=20") != key()
    assert key("regen.batch_size=4") == key() != key("regen.max_new_tokens=7")
    before = key("data.synthetic_prompts=8")
    monkeypatch.setattr(synthetic, "VERSION", synthetic.VERSION + 1)
    assert key("data.synthetic_prompts=8") != before and key() == key("regen.batch_size=4")


def _pipeline(tiny_dirs, tmp_path: Path, name: str, nproc: int = 1, **regen) -> Path:
    """The pipeline in offline mode with the engine backend, on 9 + 2 tiny prompts; `nproc` > 1 launches
    that many gloo ranks through torchrun."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    for split, n in (("rows", 10), ("val", 3)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                         for r in prompt_rows(n, seed=len(split))[:-1]))
    recipe = {"target": str(tiny_dirs["llama"]), "output_dir": str(tmp_path / name),
              "data": {"source": str(tmp_path / "rows.jsonl"), "val_source": str(tmp_path / "val.jsonl"),
                       "max_length": 128},
              "regen": {"batch_size": 8, "max_new_tokens": 16, **regen},
              "vocab": {"draft_vocab_size": 160}, "features": {"mode": "offline", "dtype": "bfloat16"},
              "train": {"ttt_steps": 2, "epochs": 1, "batch_tokens": 256, "max_steps": 3},
              "log": {"report_to": "none"}, "eval": {"num_prompts": 1, "max_new_tokens": 8, "tree": None}}
    (tmp_path / f"{name}.yaml").write_text(json.dumps(recipe))
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", str(29500 + os.getpid() % 1000)]
    r = subprocess.run([sys.executable, *launcher, "train/train_eagle3.py", "--recipe", str(tmp_path / f"{name}.yaml")],
                       cwd=repo, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path / name


def test_pipeline_captures_instead_of_dumping(tiny_dirs, tmp_path):
    """Offline features with the engine backend: the regenerate stage writes the feature store, no dump
    pass runs, and training, export and eval run from it."""
    run = _pipeline(tiny_dirs, tmp_path, "run", temperature=0.8, samples_per_prompt=2)
    summary = json.loads((run / "summary.json").read_text())
    assert not (run / "features").exists(), "a feature dump ran although the features were captured"
    assert summary["data"]["train"]["captured"] and summary["regen"]["train"]["tokens_out"] > 0
    assert summary["feature_bytes_per_token"] < 2 * 4 * 64 + 8  # bf16 storage: 2 bytes per value
    ids = [json.loads(x)["id"] for x in (run / "data/used/train.jsonl").read_text().splitlines()]
    assert len(ids) == summary["data"]["train"]["rows"] and all("~s" in i for i in ids)
    assert (run / "export" / "model.safetensors").exists() and summary["eval"]


def test_two_ranks_split_the_capture_and_index_the_same_data(tiny_dirs, tmp_path):
    """Under a 2-process launch each rank regenerates and captures its own half of the rows into its own
    shards; rank 0 indexes both. The prepared data (ids, masks, order) and every row's features equal a
    one-process run's (sampled answers included: draws are keyed by row id, not by batch). In fp32: a bf16
    target's logits move with the batch's shape (another GEMM blocking), so bf16 answers may differ between
    launch shapes, as any bf16 engine's do."""
    same = {"temperature": 0.8, "samples_per_prompt": 1, "include_greedy": True, "dtype": "float32"}
    one = _pipeline(tiny_dirs, tmp_path, "one", **same)
    two = _pipeline(tiny_dirs, tmp_path, "two", nproc=2, **same)
    for split in ("train", "val"):
        shards = sorted(p.name for p in (two / "capture" / split).glob("shard-*.json"))
        assert any(n.startswith("shard-r0-") for n in shards) and any(n.startswith("shard-r1-") for n in shards)
        a, b = FeatureStore(one / "capture" / split), FeatureStore(two / "capture" / split)
        da, db = (datasets.load_from_disk(str(d / "data" / "prepared" / split / "data")) for d in (one, two))
        assert da["input_ids"] == db["input_ids"] and da["loss_mask"] == db["loss_mask"]
        for i in range(len(da)):
            for x, y in zip(a.get(i), b.get(i)):
                torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)  # bf16 storage
    summary = json.loads((two / "summary.json").read_text())
    assert summary["regen"]["train"]["ranks"] == 2 and summary["regen"]["train"]["tokens_out"] > 0
