"""τ measured through the engine against the reference generator (infer/eval.py): same tokens, same accept
lengths, same accounting (first token from the prefill, cuts at the token limit), the oracle check's
verdicts, the CLI's refusals, and the training pipeline's quick-run sizing."""

from __future__ import annotations

import dataclasses
import json
import random
import warnings

import pytest
import torch

from tests.helpers.heads import random_head
from tsengine.eagle3.format import save_head
from tsengine.infer import eval as ev
from tsengine.infer.reference import DraftTree, ReferenceSpeculator, SpecShape, greedy_generate
from tsengine.speculative.eagle3 import Eagle3Proposer
from tsengine.targets import eos_ids

SHAPES = [(3, 1, 4), (3, 2, 6)]  # a chain and a tree
WORDS = "the a of to and in is it you that he was for on are with as his they at one have this from".split()
NEW = 24


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls on a shared 2-core machine: one thread is several times faster than two fighting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tiny_dirs, tiny_models, tmp_path_factory):
    """Prompts in a chat file, and a random head whose draft vocab is the target's 4 most frequent greedy
    tokens: it drafts only likely tokens, so some drafts are accepted (a full-vocab random head accepts none)."""
    model, tok = tiny_models["llama"]
    tmp = tmp_path_factory.mktemp("eval")
    rng = random.Random(1)
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": " ".join(
        rng.choice(WORDS) for _ in range(rng.randint(3, 12)))}]} for i in range(3)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = ev.prompts_from(str(tmp / "prompts.jsonl"), tok, None)
    seen = [t for _, ids in prompts for t in greedy_generate(model, ids, NEW, eos_ids(model, tok))]
    counts = torch.bincount(torch.tensor(seen), minlength=model.config.vocab_size)
    head = random_head(model, seed=3, draft_vocab_size=4, counts=counts)
    return {"dir": str(tiny_dirs["llama"]), "model": model, "tok": tok, "head": head, "prompts": prompts,
            "head_dir": str(save_head(head, tmp / "head")), "prompt_file": str(tmp / "prompts.jsonl")}


@pytest.fixture(scope="module")
def engine_results(setup):
    return ev.evaluate_engine(setup["dir"], setup["head_dir"], setup["prompts"], SHAPES, NEW, progress=False,
                              debug_checks=True)


def test_engine_eval_equals_the_reference(setup, engine_results):
    ref = ev.evaluate(setup["model"], setup["tok"], setup["head"], setup["prompts"], SHAPES, NEW, progress=False)
    assert list(ref) == list(engine_results) == ["3,1,4", "3,2,6"]
    accepted = 0
    for key, r in ref.items():
        e = engine_results[key]
        assert (e["backend"], r["backend"]) == ("engine", "reference")
        for a, b in zip(r["per_prompt"], e["per_prompt"]):
            assert (a["id"], a["output_ids"], a["accept_lengths"]) == (b["id"], b["output_ids"], b["accept_lengths"])
            assert a["tokens"] == len(a["output_ids"]) - 1 == sum(a["accept_lengths"])  # first token: the prefill
        for f in ("tau", "tokens", "verify_steps", "accept_hist"):
            assert e[f] == r[f], (key, f)
        hist = e["accept_hist"]
        assert sum(hist) == e["verify_steps"] and sum(k * c for k, c in enumerate(hist)) == e["tokens"]
        accepted += sum(hist[2:])
    assert accepted > 0  # the comparison covers real acceptance, not only rejections


def test_accounting_with_every_accept_length(setup, monkeypatch):
    """Chain drafts from the known greedy continuation, wrong from a depth chosen by (prompt, step), given
    to both backends: every accept length occurs and the last step is cut at the token limit."""
    model, tok, prompts, s, new = setup["model"], setup["tok"], setup["prompts"], 3, 19
    truth = {tuple(ids): greedy_generate(model, ids, new + s + 1, eos_ids(model, tok)) + [0] * 8
             for _, ids in prompts}

    def drafts(prompt: tuple, done: int) -> list[int]:
        good = (len(prompt) * 7 + done * 13) % (s + 1)
        cont = truth[prompt][done:done + s]
        return cont[:good] + [(t + 1) % 256 for t in cont[good:]]

    def ref_drafter(tokens, feats):
        p = next(tuple(ids) for _, ids in prompts if tuple(tokens[:len(ids)]) == tuple(ids))
        return DraftTree(drafts(p, len(tokens) - len(p)), list(range(-1, s - 1)))

    inner = Eagle3Proposer.propose

    def oracle_propose(self, proposal):
        return [None if d is None else dataclasses.replace(
                    d, tokens=torch.tensor(drafts(tuple(seq.tokens[:seq.prompt_len]), seq.num_output)))
                for seq, d in zip(proposal.drafting, inner(self, proposal))]

    monkeypatch.setattr(Eagle3Proposer, "propose", oracle_propose)
    eng = ev.evaluate_engine(setup["dir"], setup["head_dir"], prompts, [(s, 1, s + 1)], new, progress=False)["3,1,4"]
    spec = ReferenceSpeculator(model, None, SpecShape(s, 1, s + 1), drafter=ref_drafter)
    rows = [ev._row(pid, o.tokens, o.accept_lengths)
            for pid, o in ((pid, spec.generate(ids, new, eos_ids(model, tok))) for pid, ids in prompts)]
    assert [r["accept_lengths"] for r in rows] == [r["accept_lengths"] for r in eng["per_prompt"]]
    assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in eng["per_prompt"]]
    assert all(h > 0 for h in eng["accept_hist"][1:])  # 1..S+1 tokens per step all occur
    assert all(len(r["output_ids"]) == new for r in rows)
    done = [1 + sum(r["accept_lengths"][:-1]) for r in rows]  # tokens before each prompt's last step
    natural = [(len(ids) * 7 + d * 13) % (s + 1) + 1 for (_, ids), d in zip(prompts, done)]
    assert any(n > r["accept_lengths"][-1] for n, r in zip(natural, rows))  # a last step cut at the token limit
    assert eng["tau"] == sum(r["tokens"] for r in rows) / sum(r["verify_steps"] for r in rows)


def _reference(setup):
    return lambda: (setup["model"], setup["tok"], setup["head"])


def test_oracle_passes_on_the_engine_output(setup):
    res = ev.measure("engine", setup["prompts"], SHAPES[1:], NEW, target=setup["dir"], draft=setup["head_dir"],
                     reference=_reference(setup), oracle_prompts=2, progress=False)
    statuses = [p["status"] for p in res["3,2,6"]["oracle"]["prompts"]]
    assert statuses == ["match", "match"]
    assert [p["id"] for p in res["3,2,6"]["oracle"]["prompts"]] == ["p0", "p1"]  # evenly spaced over 3
    ev.raise_on_mismatch(res)
    assert "2 match" in ev.table(res)


def test_oracle_raises_on_a_changed_engine_token(setup, monkeypatch):
    from tsengine.entrypoints.llm import LLM

    inner = LLM.generate

    def corrupt(self, *a, **kw):
        outs = inner(self, *a, **kw)
        ids = outs[0].outputs[0].token_ids
        ids[5] = (ids[5] + 1) % 256
        return outs

    monkeypatch.setattr(LLM, "generate", corrupt)
    res = ev.measure("engine", setup["prompts"], SHAPES[:1], NEW, target=setup["dir"], draft=setup["head_dir"],
                     reference=_reference(setup), oracle_prompts=1, progress=False)
    verdict = res["3,1,4"]["oracle"]["prompts"][0]
    assert verdict["status"] == "mismatch" and verdict["position"] == 5, verdict
    with pytest.raises(ev.OracleMismatch, match=r"3,1,4 prompt p0: first difference at generated position 5"):
        ev.raise_on_mismatch(res)


def test_oracle_near_tie_is_a_warning(setup, monkeypatch):
    from tsengine.infer import reference
    from tsengine.infer.reference import Agreement

    monkeypatch.setattr(reference, "compare_to_greedy", lambda *a: Agreement("near-tie", 7, 3e-6))
    with pytest.warns(ev.EvalWarning, match=r"position 7, a near-tie .*3\.00e-06"):
        res = ev.measure("engine", setup["prompts"], SHAPES[:1], NEW, target=setup["dir"],
                         draft=setup["head_dir"], reference=_reference(setup), oracle_prompts=1, progress=False)
    assert res["3,1,4"]["oracle"]["prompts"][0] == {"id": "p0", "status": "near-tie", "position": 7,
                                                     "rel_gap": 3e-6}
    ev.raise_on_mismatch(res)  # allowed


def test_cli_runs_and_writes_the_oracle_verdicts(setup, tmp_path, capsys):
    """3,4,6 is a valid reference shape the engine refuses ((S-1)·K = 8 > N = 6): the reference measures it."""
    out = tmp_path / "eval.json"
    rc = ev.main(["--target", setup["dir"], "--draft", setup["head_dir"], "--prompts", setup["prompt_file"],
                  "--tree", "3,4,6", "--num-prompts", "2", "--max-new-tokens", "12", "--oracle-prompts", "1",
                  "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["3,1,4"]["oracle"]["prompts"][0]["status"] == "match" and len(res["3,1,4"]["per_prompt"]) == 2
    assert res["3,1,4"]["backend"] == "engine" and "engine_refused" not in res["3,1,4"]
    assert res["3,4,6"]["backend"] == "reference" and "8 draft lanes exceed" in res["3,4,6"]["engine_refused"]
    captured = capsys.readouterr()
    assert "eval: 2 prompts x 12 new tokens, engine backend" in captured.out
    assert "eval 3,4,6: the engine does not run this shape" in captured.err


@pytest.mark.parametrize("args, needle", [
    (["--tree", "2,2,9"], "num_draft_tokens 9 exceeds what 2 steps of top-2 can draft"),
    (["--steps", "0"], "steps is 0; must be >= 1"),
    (["--num-draft-tokens", "6"], "a chain (topk 1) needs num_draft_tokens = steps + 1 = 4"),
    (["--topk", "2"], "--num-draft-tokens is required for a tree"),
    (["--oracle-prompts", "-1"], "--oracle-prompts is -1; must be >= 0"),
])
def test_cli_mistakes_exit_2_without_traceback(setup, capsys, args, needle):
    rc = ev.main(["--target", setup["dir"], "--draft", setup["head_dir"], "--prompts", setup["prompt_file"], *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_cli_bad_shape_syntax_and_backend_are_argparse_errors(setup, capsys):
    for args in (["--tree", "6,8"], ["--backend", "hf"]):
        with pytest.raises(SystemExit) as e:
            ev.main(["--target", setup["dir"], "--draft", setup["head_dir"], "--prompts", setup["prompt_file"], *args])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected S,K,N (three integers), got '6,8'" in err and "invalid choice: 'hf'" in err


def test_pipeline_eval_is_sized_to_a_quick_run(setup, tmp_path):
    from tsengine.train import recipe
    from tsengine.train.evaluation import QUICK_EVAL
    from tsengine.train.evaluation import evaluate as _eval

    root = tmp_path / "run"
    save_head(setup["head"], root / "export")
    stage = root / "data" / "prepared" / "val"
    stage.mkdir(parents=True)
    many = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"write {i} words"}]} for i in range(8)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in many))
    (stage / "stage.json").write_text(json.dumps({"source": str(tmp_path / "val.jsonl")}))
    r = recipe.validate({"target": setup["dir"], "train": {"max_steps": 8},
                         "eval": {"num_prompts": 20, "max_new_tokens": 100, "oracle_prompts": 1, "tree": [3, 2, 6]}})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ev.EvalWarning)
        out = _eval(r, setup["model"], setup["tok"], root)
    assert (out["num_prompts"], out["max_new_tokens"]) == QUICK_EVAL == (4, 64)
    for shape in ("3,1,4", "3,2,6"):
        assert out[shape]["backend"] == "engine" and out[shape]["oracle"] == ["match"]
    assert out["wall_s"] >= 0
    saved = json.loads((root / "eval.json").read_text())["3,1,4"]
    assert len(saved["per_prompt"]) == 4 and max(len(p["output_ids"]) for p in saved["per_prompt"]) <= 64
    user = _eval(r, setup["model"], setup["tok"], root, user_sized=True)  # eval.num_prompts=... on the command line
    assert (user["num_prompts"], user["max_new_tokens"]) == (20, 100)  # the user's numbers (all 8 prompts run)


@pytest.mark.parametrize("quantization", ["bf16", "int8"])
def test_a_quantized_eval_is_checked_against_the_head_the_engine_serves(setup, monkeypatch, quantization):
    """`--draft-quantization bf16|int8`: the engine serves the head so, the oracle's reference drafts with
    the head's weights rounded the same way (a copy: the caller's head is untouched), and the two agree."""
    import copy

    from tsengine.entrypoints import llm as llm_module
    from tsengine.infer import reference
    from tsengine.model.linear import round_weights

    seen, served = [], []

    class Recording(reference.ReferenceSpeculator):
        def __init__(self, model, head, shape):
            seen.append(head)
            super().__init__(model, head, shape)

    class Serving(llm_module.LLM):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            served.append(self.engine.config.speculative.draft_model_quantization)

    monkeypatch.setattr(reference, "ReferenceSpeculator", Recording)
    monkeypatch.setattr(llm_module, "LLM", Serving)
    before = copy.deepcopy(setup["head"].state_dict())
    res = ev.measure("engine", setup["prompts"], SHAPES[:1], NEW, target=setup["dir"], draft=setup["head_dir"],
                     reference=lambda: (setup["model"], setup["tok"], setup["head"]),
                     oracle_prompts=3, progress=False, draft_quantization=quantization)["3,1,4"]
    assert served == [quantization] and res["draft_quantization"] == quantization
    assert [p["status"] for p in res["oracle"]["prompts"]] == ["match"] * 3
    want = round_weights(copy.deepcopy(setup["head"]), quantization).state_dict()
    assert len(seen) == 1 and not torch.equal(want["fc.weight"], before["fc.weight"])
    for name, tensor in seen[0].state_dict().items():
        assert torch.equal(tensor, want[name]), name
    for name, tensor in setup["head"].state_dict().items():
        assert torch.equal(tensor, before[name]), f"the caller's head was changed: {name}"
