"""The command lines as a user runs them: real processes, exit codes, no tracebacks for mistakes."""

import json
import subprocess
import sys
import time

import pytest
import torch


def run(*args, env=None):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


def test_head_init_then_reference_generate(tiny_dirs, tmp_path):
    target = str(tiny_dirs["llama"])
    head = tmp_path / "head"
    r = run("-m", "tsengine.entrypoints.cli", "head", "init", "--target", target, "--out", str(head),
            "--draft-vocab-size", "128", "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(head)
    cfg = json.loads((head / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 128
    r = run("-m", "tsengine.infer.generate", "--target", target, "--draft", str(head), "--prompt", "the water",
            "--topk", "2", "--steps", "3", "--num-draft-tokens", "7", "--max-new-tokens", "12", "--json",
            "--check-greedy")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"tokens", "accept_lengths", "text", "greedy_check"}
    assert len(out["tokens"]) <= 12 and sum(out["accept_lengths"]) == len(out["tokens"]) - 1
    assert out["greedy_check"]["status"] in ("match", "near-tie")


def test_head_init_with_token_counts(tiny_dirs, tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({"300": 50, "7": 10}))
    r = run("-m", "tsengine.entrypoints.cli", "head", "init", "--target", str(tiny_dirs["qwen3"]),
            "--out", str(tmp_path / "h"), "--draft-vocab-size", "2", "--token-counts", str(counts))
    assert r.returncode == 0, r.stderr
    from safetensors.torch import load_file

    d2t = load_file(tmp_path / "h" / "model.safetensors")["d2t"]
    assert (d2t + torch.arange(2)).tolist() == [7, 300]


@pytest.mark.parametrize("args,needle", [
    (["tsengine.entrypoints.cli", "head", "init", "--target", "/no/such/dir", "--out", "{out}"],
     "is not a model directory"),
    (["tsengine.entrypoints.cli", "head", "init", "--target", "{llama}", "--out", "{out}",
      "--draft-vocab-size", "100000"],
     "draft_vocab_size (100000) must be <= vocab_size (384)"),
    (["tsengine.entrypoints.cli", "head", "init", "--target", "{llama}", "--out", "{out}", "--draft-vocab-size", "0"],
     "expected a positive integer"),
    (["tsengine.entrypoints.cli", "head", "init", "--target", "{llama}", "--out", "{out}", "--aux-layer-ids", "1,2"],
     "expected three comma-separated layer ids"),
    (["tsengine.entrypoints.cli", "pull", "gpt-17"], "unknown embedded target 'gpt-17'; available: smollm2-135m"),
    (["tsengine.infer.generate", "--target", "{llama}", "--draft", "/no/head", "--prompt", "x"],
     "draft head directory /no/head does not exist"),
    (["tsengine.infer.generate", "--target", "{llama}", "--draft", "/no/head", "--prompt", "x", "--topk", "2"],
     "--num-draft-tokens is required for a tree"),
    (["tsengine.infer.generate", "--target", "{llama}", "--draft", "/no/head", "--prompt", "x",
      "--num-draft-tokens", "9"],
     "needs num_draft_tokens = steps + 1 = 4"),
])
def test_user_mistakes_exit_nonzero_without_traceback(tiny_dirs, args, needle, tmp_path):
    args = [a.replace("{llama}", str(tiny_dirs["llama"])).replace("{out}", str(tmp_path / "out")) for a in args]
    r = run("-m", *args)
    assert r.returncode == 2
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_engine_generate_with_speculation(tiny_dirs, tmp_path):
    target = str(tiny_dirs["llama"])
    head = tmp_path / "head"
    assert run("-m", "tsengine.entrypoints.cli", "head", "init", "--target", target, "--out", str(head),
               "--draft-vocab-size", "128").returncode == 0
    common = ["-m", "tsengine.entrypoints.cli", "generate", "--model", target, "--prompt", "the water",
              "--max-tokens", "12", "--ignore-eos"]
    plain = run(*common)
    spec = run(*common, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
               "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert plain.stdout == spec.stdout and plain.stdout.strip()
    assert "tau" in spec.stderr and "tok/s" in plain.stderr
    tree = run(*common, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
               "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
               "--no-speculative-adaptive")  # pinned: the tree every step
    assert tree.returncode == 0 and tree.stdout == plain.stdout, tree.stderr
    ngram = run(*common, "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3")
    assert ngram.returncode == 0 and ngram.stdout == plain.stdout, ngram.stderr
    adaptive = run(*common, "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head),
                   "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens",
                   "6", "--speculative-adaptive")
    assert adaptive.returncode == 0 and adaptive.stdout == plain.stdout, adaptive.stderr
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head)]
    sampled = [*common, "--temperature", "0.8", "--seed-sample", "4"]
    for rule in (["--speculative-num-steps", "2", "--enable-speculative-sampling"],
                 ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                  "--speculative-num-draft-tokens", "6", "--spec-tree-sampling", "multiround"]):
        first, again = run(*sampled, *eagle, *rule), run(*sampled, *eagle, *rule)
        assert first.returncode == 0 and first.stdout == again.stdout and first.stdout.strip(), first.stderr


@pytest.mark.parametrize("args, needle", [
    (["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "5"], "speculative_num_steps + 1 = 4"),
    (["--speculative-num-steps", "11"], "allowed: 1..10"),
    (["--speculative-num-steps", "6", "--speculative-eagle-topk", "17", "--speculative-num-draft-tokens", "65"],
     "speculative_eagle_topk is 17; allowed: 1..16\n  - speculative_num_draft_tokens is 65; allowed: 2..64"),
    (["--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
     "16 draft lanes exceed speculative_num_draft_tokens 8"),
    (["--speculative-config", '{"method": "eagle3", "model": "h", "num_speculative_tokens": 2}',
      "--speculative-num-steps", "3"], "conflicts"),
    (["--speculative-config", "{nope"], "not valid JSON"),
    (["--block-size", "0"], "allowed: 1..256"),
    (["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
      "--enable-speculative-sampling"], "use --spec-tree-sampling multiround for trees"),
    (["--spec-tree-sampling", "multiround"], "a chain (speculative_eagle_topk 1) uses --enable-speculative-sampling"),
])
def test_engine_flag_mistakes(tiny_dirs, tmp_path, args, needle):
    head = tmp_path / "head"
    run("-m", "tsengine.entrypoints.cli", "head", "init", "--target", str(tiny_dirs["llama"]), "--out", str(head),
        "--draft-vocab-size", "128")
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head)] \
        if "--speculative-config" not in args else []
    r = run("-m", "tsengine.entrypoints.cli", "generate", "--model", str(tiny_dirs["llama"]), "--prompt", "x",
            *spec, *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_concurrent_first_pulls_both_succeed(tmp_path, monkeypatch):
    """Two first pulls at once (two servers starting on a fresh machine): one converts, the other waits
    for it and reuses the result. Before the lock the loser crashed at `out.rmdir()` (Errno 39)."""
    import threading

    from tsengine import targets

    conversions = []

    def slow_convert(gguf, out):
        conversions.append(out)
        time.sleep(0.3)  # both pulls are inside at once without the lock
        (out / "model.safetensors").write_bytes(b"stand-in")

    monkeypatch.setattr(targets, "_convert", slow_convert)
    monkeypatch.setattr(targets, "_find_gguf", lambda spec: tmp_path / "stand-in.gguf")
    monkeypatch.setattr(targets.metadata, "version", lambda package: "0")
    dest, results, errors = tmp_path / "model", [], []

    def pull():
        try:
            results.append(targets.pull("smollm2-135m", dest, quiet=True))
        except Exception as e:  # recorded: the assertion below shows it
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and results == [dest, dest] and len(conversions) == 1
    assert (dest / targets.MARKER).exists() and (dest / "model.safetensors").read_bytes() == b"stand-in"


def test_served_model_name_defaults_to_a_name_not_a_path(tmp_path):
    from tsengine.entrypoints.openai.settings import default_model_name

    local = tmp_path / "SmolLM2-135M-Instruct"
    local.mkdir()
    assert default_model_name(str(local)) == "SmolLM2-135M-Instruct"
    assert default_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert default_model_name("smollm2-135m") == "smollm2-135m"


def test_tune_measures_every_configuration_and_recommends_flags(tiny_dirs, heads, tmp_path, capsys):
    from tsengine.entrypoints.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the water is hot and\nonce upon a time\n")
    out = tmp_path / "tune"
    assert main(["tune", "--model", str(tiny_dirs["llama"]), "--draft", str(heads["llama"]), "--prompts",
                 str(prompts), "--concurrency", "1,2", "--max-tokens", "6", "--steps", "2", "--trees", "2x2x4",
                 "--max-model-len", "128", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads((out / "tune.json").read_text())
    names = {r["name"] for r in report["rows"]}
    assert names == {"plain", "ngram 2", "chain 1", "chain 2", "tree 2x2x4", "adaptive 0..2"}
    assert len(report["rows"]) == 6 * 2 and all(r["tok_s"] > 0 for r in report["rows"])
    assert all(r["speedup"] == 1.0 for r in report["rows"] if r["name"] == "plain")
    shares = [r["choices"] for r in report["rows"] if r["name"] == "adaptive 0..2"]
    assert all(sum(s.values()) == pytest.approx(1.0) for s in shares) and len(shares) == 2
    assert set(report["recommended"]) == {"1", "2"} and report["repeats"] == 2
    assert (out / "tune.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "recommended, per load:" in printed and "tsengine serve --model" in printed
    assert main(["tune", "--model", "x", "--prompts", str(prompts), "--trees", "6x8x32"]) == 2  # lane rule


def test_tune_int8_serves_every_head_configuration_in_int8():
    """`tune --draft-quantization int8`: each head candidate's serve flags and engine config carry int8;
    plain and NGRAM carry nothing."""
    from tsengine.config import SpeculativeConfig
    from tsengine.entrypoints.tune import candidates

    cands = candidates("HEAD", 2, [(3, 2, 6)], True, "int8")
    heads = [c for c in cands if c.spec and c.spec["algorithm"] == "EAGLE3"]
    assert len(heads) == 4 and {c.name for c in cands} - {c.name for c in heads} == {"plain", "ngram 2"}
    for c in heads:
        assert c.flags[-2:] == ["--speculative-draft-model-quantization", "int8"], c.name
        assert SpeculativeConfig.resolve(**c.spec).draft_model_quantization == "int8", c.name
    assert all("--speculative-draft-model-quantization" not in c.flags for c in cands if c not in heads)

