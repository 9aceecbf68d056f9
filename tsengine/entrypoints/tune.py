"""`tsengine tune`: measure speculation configurations on the user's own prompts and recommend one per load.

A fixed speculative configuration wins at some loads and loses at others, and the answer depends on the
machine, the head and the prompts. This runs the choices a user would otherwise guess between on this
machine, with the user's prompts:
- plain decoding;
- NGRAM;
- EAGLE-3 chains of each length 1..S, and a few tree shapes;
- adaptive speculation (tsengine/speculative/adaptive/policy.py) over all of these: plain, prompt lookup per request,
  chains 1..S and the largest tree given.

Each runs at each concurrency. It prints a table (output tok/s, τ, speedup over plain), writes it as JSON
and a PNG, and prints the `tsengine serve` flags of the fastest configuration for each load.

Each configuration gets one engine, sized for the highest concurrency. A level caps the running requests
at its concurrency and decodes `max(concurrency, #prompts)` requests of `--max-tokens` each, EOS ignored,
so every configuration decodes the same tokens. Greedy unless `--temperature`.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from tsengine.config import SpeculativeConfig, tree_shape_problems
from tsengine.conversations import load_rows, normalize
from tsengine.errors import UserError


@dataclass
class Candidate:
    name: str
    flags: list[str]  # what `tsengine serve` needs to run it
    spec: dict | None  # SpeculativeConfig.resolve keyword arguments, None: plain


@dataclass
class Measured:
    name: str
    concurrency: int
    tok_s: float
    tau: float | None
    speedup: float | None = None  # over plain at the same concurrency
    choices: dict[str, float] | None = None  # adaptive: the share of steps per choice (plain, chain k, tree)


def candidates(draft: str | None, steps: int, trees: list[tuple[int, int, int]], ngram: bool,
               draft_quantization: str = "none") -> list[Candidate]:
    """`draft_quantization` bf16 or int8: every head candidate serves the head so (its flags say so)."""
    out = [Candidate("plain", [], None)]
    if ngram:
        out.append(Candidate(f"ngram {steps}", ["--speculative-algorithm", "NGRAM", "--speculative-num-steps",
                                                str(steps)], {"algorithm": "NGRAM", "num_steps": steps}))
    if draft:
        eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft]
        for k in range(1, steps + 1):
            out.append(Candidate(f"chain {k}", [*eagle, "--speculative-num-steps", str(k), "--no-speculative-adaptive"],
                                 {"algorithm": "EAGLE3", "draft_model_path": draft, "num_steps": k, "adaptive": False}))
        for s, k, n in trees:
            out.append(Candidate(f"tree {s}x{k}x{n}", [*eagle, "--speculative-num-steps", str(s),
                                                        "--speculative-eagle-topk", str(k),
                                                        "--speculative-num-draft-tokens", str(n),
                                                        "--no-speculative-adaptive"],
                                 {"algorithm": "EAGLE3", "draft_model_path": draft, "num_steps": s, "eagle_topk": k,
                                  "num_draft_tokens": n, "adaptive": False}))
        # adaptive chooses among plain, NGRAM, chains 1..S and the largest tree (S: that tree's depth)
        tree = max(trees, key=lambda t: t[2]) if trees else None
        depth = tree[0] if tree else steps
        shape = {"eagle_topk": tree[1], "num_draft_tokens": tree[2]} if tree else {}
        tree_flags = [] if tree is None else ["--speculative-eagle-topk", str(tree[1]),
                                              "--speculative-num-draft-tokens", str(tree[2])]
        out.append(Candidate(f"adaptive 0..{depth}", [*eagle, "--speculative-num-steps", str(depth), *tree_flags],
                             {"algorithm": "EAGLE3", "draft_model_path": draft, "num_steps": depth, "adaptive": True,
                              **shape}))
    if draft_quantization != "none":
        for cand in out:
            if cand.spec and cand.spec["algorithm"] == "EAGLE3":
                cand.flags += ["--speculative-draft-model-quantization", draft_quantization]
                cand.spec["draft_model_quantization"] = draft_quantization
    return out


def parse_trees(text: str) -> list[tuple[int, int, int]]:
    """"3x2x6,4x4x12" -> [(3, 2, 6), (4, 4, 12)] (steps x topk x nodes), each shape checked."""
    shapes = []
    for part in filter(None, text.split(",")):
        try:
            s, k, n = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise UserError(f"--trees: {part!r} is not STEPSxTOPKxNODES, e.g. 3x2x6") from None
        if problems := tree_shape_problems(s, k, n):
            raise UserError(f"--trees: {part}: " + "; ".join(problems))
        shapes.append((s, k, n))
    return shapes


def read_prompts(path: str) -> list:
    """A .txt file: one raw prompt per line. JSON/JSONL/Parquet: chat rows (ShareGPT or OpenAI shape), each
    rendered with the chat template up to its first assistant turn."""
    if path.endswith(".txt"):
        try:
            lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        except OSError as e:
            raise UserError(f"--prompts {path}: {e.strerror}") from None
        if not lines:
            raise UserError(f"--prompts {path}: no prompt in it")
        return lines
    chats = []
    for row in load_rows(path):
        try:
            turns = normalize(row, require_assistant=False)
        except ValueError:
            continue
        first = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
        chats.append(turns[:first])
    if not chats:
        raise UserError(f"--prompts {path}: no usable chat row (messages or conversations with a user turn)")
    return chats


def measure(model: str, candidate: Candidate, prompts: list, levels: list[int], max_tokens: int,
            temperature: float, engine_kw: dict, repeats: int = 1) -> list[Measured]:
    """Each level `repeats` times; the median tok/s: a shared CPU's speed moves by tens of percent between
    runs (docs/benchmarks-journal.md, "`tsengine tune` on the embedded target (issue 15, previous revision)")."""
    from tsengine.entrypoints.llm import LLM
    from tsengine.model.compile_worker import WORKER
    from tsengine.model.graphs import TOKENS_TO_HEAT
    from tsengine.sampling_params import SamplingParams

    spec = SpeculativeConfig.resolve(**candidate.spec) if candidate.spec else None
    llm = LLM(model, speculative=spec, max_num_seqs=max(levels), **engine_kw)
    engine = llm.engine
    tok = llm.tokenizer
    texts = [p if isinstance(p, str) else tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
             for p in prompts]  # as LLM.chat renders them
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    llm.generate([ids[0]], SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True))  # warm-up
    out = []
    for c in levels:
        engine.scheduler.max_num_seqs = c  # the engine is sized for the largest level
        batch = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(max(c, len(ids)))]
        # untimed: the level's batch shapes become hot and compile (off the engine thread) before its timed
        # rounds, which would otherwise run them eagerly beside their compiles
        llm.generate(batch, SamplingParams(temperature=temperature, max_tokens=TOKENS_TO_HEAT, ignore_eos=True,
                                           seed=0))
        WORKER.wait()
        verify0, accepted0 = engine.stats.num_drafts, engine.stats.num_accepted
        policy = engine.proposer.adaptive_policy()
        chosen0 = dict(policy.chosen) if policy is not None else {}
        speeds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            results = llm.generate(batch, params)
            speeds.append(sum(len(r.outputs[0].token_ids) for r in results) / (time.perf_counter() - t0))
        verify, accepted = engine.stats.num_drafts - verify0, engine.stats.num_accepted - accepted0
        choices = None
        if policy is not None:
            steps = {k: n - chosen0.get(k, 0) for k, n in policy.chosen.items() if n > chosen0.get(k, 0)}
            choices = {k: n / sum(steps.values()) for k, n in sorted(steps.items(), key=lambda kv: -kv[1])}
        out.append(Measured(candidate.name, c, statistics.median(speeds),
                            (accepted + verify) / verify if verify else None, choices=choices))
    return out


def recommend(rows: list[Measured]) -> dict[int, Measured]:
    """The fastest configuration at each concurrency."""
    best = {}
    for r in rows:
        if r.concurrency not in best or r.tok_s > best[r.concurrency].tok_s:
            best[r.concurrency] = r
    return best


def tune(model: str, draft: str | None, prompts_path: str, levels: list[int], max_tokens: int, steps: int,
         trees: list[tuple[int, int, int]], out_dir: str, temperature: float = 0.0, ngram: bool = True,
         engine_kw: dict | None = None, repeats: int = 1, draft_quantization: str = "none") -> dict:
    prompts = read_prompts(prompts_path)
    cands = candidates(draft, steps, trees, ngram, draft_quantization)
    rows: list[Measured] = []
    for cand in tqdm(cands, desc="tune", unit="config"):
        rows += measure(model, cand, prompts, levels, max_tokens, temperature, engine_kw or {}, repeats)
    plain = {r.concurrency: r.tok_s for r in rows if r.name == "plain"}
    for r in rows:
        r.speedup = r.tok_s / plain[r.concurrency] if plain.get(r.concurrency) else None
    by_name = {c.name: c for c in cands}
    best = recommend(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"model": model, "draft": draft, "draft_quantization": draft_quantization, "prompts": prompts_path,
              "max_tokens": max_tokens,
              "temperature": temperature, "repeats": repeats, "rows": [asdict(r) for r in rows],
              "recommended": {str(c): {"config": r.name, "tok_s": r.tok_s, "speedup": r.speedup,
                                       "serve_flags": by_name[r.name].flags} for c, r in best.items()}}
    (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, levels, out / "tune.png", model)
    return report


def plot(rows: list[Measured], levels: list[int], path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.name for r in rows):
        mine = [r for r in rows if r.name == name]
        ax.plot([r.concurrency for r in mine], [r.tok_s for r in mine], marker="o", label=name,
                linestyle="--" if name == "plain" else "-")
    ax.set(xscale="log", xlabel="concurrency", ylabel="output tok/s", title=f"tsengine tune: {model}")
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(report: dict, model: str) -> None:
    print("| config | concurrency | output tok/s | τ | vs plain | steps by choice (adaptive) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in report["rows"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        speed = f"{r['speedup']:.2f}×" if r["speedup"] else "-"
        chose = ", ".join(f"{k} {v:.0%}" for k, v in (r.get("choices") or {}).items())
        print(f"| {r['name']} | {r['concurrency']} | {r['tok_s']:.1f} | {tau} | {speed} | {chose} |")
    print("\nrecommended, per load:")
    for c, rec in report["recommended"].items():
        flags = " ".join(rec["serve_flags"])
        print(f"  concurrency {c}: {rec['config']} ({rec['tok_s']:.1f} tok/s, {rec['speedup']:.2f}× plain): "
              f"tsengine serve --model {model} {flags}".rstrip())

