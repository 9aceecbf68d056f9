"""Engine decode speed at batch 1 vs HF `generate`, and EAGLE-3 chain speculation vs our own plain decode.

All rows run in one process, side by side, on the same prompts (the built-in validation prompts, evenly
spaced), greedy, `--max-tokens` new tokens each (EOS ignored so every row decodes the same count):

    python bench/engine_speed.py --draft DIR[,DIR2] [--random-head] [--prompts 8 --max-tokens 128 --repeats 3]
                                 [--shapes 3,1,4;5,4,16;4,8,32] [--ngram] [--temperature 0.7] [--no-hf]
                                 [--modes compiled,eager] [--extend-graphs] [--bf16] [--int8]

`--modes`: every engine row once per mode, side by side: compiled step graphs (the default,
tsengine/model/graphs.py) and eager (`--enforce-eager`). The warm-up decodes the longest prompt to the full
length first, so every graph a timed row needs is compiled before the clock starts.

`--bf16` / `--int8` add each EAGLE-3 row again with the head's weights in bf16 / int8
(`--speculative-draft-model-quantization`): τ may move (the drafts are the rounded head's), outputs may not.

`--shapes` lists EAGLE-3 shapes as steps,topk,num_draft_tokens (topk 1: chain; > 1: EAGLE-2 tree), one
row each. At `--temperature` > 0 every request is seeded, so every row must still equal the plain row.

Reports tokens/s per row (median over repeats of the whole prompt set), ratios, τ (tokens per verify
step) and the engine's per-step time split (target forward+sampling / commit / draft). Speculative rows
are checked token for token against the plain rows (a mismatch is printed, never hidden).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _val_file() -> str:
    from tsengine.train.prompts import write_jsonl

    return str(write_jsonl(tempfile.mkdtemp(), 0.05)[1])


def val_prompts(tok, n: int) -> list[list[int]]:
    """n built-in validation prompts (never trained on), evenly spaced by id, chat-templated."""
    from tsengine.infer.eval import prompts_from

    return [ids for _, ids in prompts_from(_val_file(), tok, n)]


def val_prompts_text(n: int) -> list[str]:
    import json

    rows = sorted((json.loads(line) for line in open(_val_file(), encoding="utf-8")), key=lambda r: str(r["id"]))
    step = max(1, len(rows) // n)
    return [r["messages"][0]["content"] if "messages" in r else r["conversations"][0]["value"]
            for r in rows[::step][:n]]


def hf_row(path, prompts, n) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs, t0 = [], time.perf_counter()
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return len(prompts) * n / (time.perf_counter() - t0), outs


def engine_row(llm, prompts, n, temperature=0.0):
    from tsengine.sampling_params import SamplingParams

    e = llm.engine
    st = e.stats
    before = (st.time_forward, st.time_commit, st.time_draft, st.steps, st.num_drafts, st.num_accepted)
    sp = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=1234)
    t0 = time.perf_counter()
    outs = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]  # batch 1: one request at a time
    dt = time.perf_counter() - t0
    d = [a - b for a, b in zip((st.time_forward, st.time_commit, st.time_draft, st.steps, st.num_drafts,
                                st.num_accepted), before)]
    split = {"forward": d[0] / dt, "commit": d[1] / dt, "draft": d[2] / dt}
    tau = (d[5] + d[4]) / d[4] if d[4] else None
    return len(prompts) * n / dt, outs, split, tau, d[3]


def main() -> None:
    from tsengine.entrypoints.llm import LLM
    from tsengine.targets import resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", help="trained EAGLE-3 head directory (comma-separated: each one's rows, the later "
                    "ones named by their directory)")
    ap.add_argument("--random-head", action="store_true", help="also time an untrained head (speculating for nothing)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps of the random-head row")
    ap.add_argument("--shapes", default="3,1,4", help="EAGLE-3 rows: steps,topk,num_draft_tokens[;...]")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ngram", action="store_true", help="also an NGRAM (prompt lookup) row, --steps tokens")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--extend-graphs", action="store_true", help="also each compiled EAGLE-3 row with the head's "
                    "extension in a graph (TSENGINE_EXTEND_GRAPHS=1's opt-in, tsengine/model/graphs.py)")
    ap.add_argument("--bf16", action="store_true", help="also each EAGLE-3 row with the head's weights in bf16")
    ap.add_argument("--int8", action="store_true", help="also each EAGLE-3 row with the head in int8")
    ap.add_argument("--modes", default="compiled,eager",
                    help="engine modes, one set of rows each: compiled (step graphs, the default) and/or eager")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    path = resolve(args.target)
    rows = {}
    for mode in args.modes.split(","):
        eager, tag = mode == "eager", "" if mode == "compiled" else f" [{mode}]"
        kw = dict(max_num_seqs=1, enable_prefix_caching=False, enforce_eager=eager)
        rows["plain" + tag] = LLM(path, **kw)
        for i, draft in enumerate(args.draft.split(",") if args.draft else []):
            which = "" if i == 0 else f" [{Path(draft).name}]"
            for shape in args.shapes.split(";"):
                st, k, n = (int(x) for x in shape.split(","))
                spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": st, "eagle_topk": k,
                        "num_draft_tokens": n, "adaptive": False}
                for quant in ("none", *(["bf16"] if args.bf16 else []), *(["int8"] if args.int8 else [])):
                    name = f"eagle3 ({st},{k},{n})" + ("" if quant == "none" else f" {quant}") + which
                    spec = {**spec, "quantization": quant}
                    rows[name + tag] = LLM(path, **kw, speculative_config=spec)
                    if args.extend_graphs and not eager:
                        llm = rows[name + " +extend graph"] = LLM(path, **kw, speculative_config=spec)
                        llm.engine.proposer.graphs.extends = True
        if args.ngram:
            rows[f"ngram ({args.steps}){tag}"] = LLM(path, **kw, speculative_config={
                "method": "ngram", "num_speculative_tokens": args.steps})
    plain_name = next(iter(rows))
    prompts = val_prompts(rows[plain_name].tokenizer, args.prompts)
    if args.random_head:
        from transformers import AutoConfig

        from tsengine.eagle3.config import Eagle3Config
        from tsengine.eagle3.format import save_head
        from tsengine.eagle3.head import Eagle3Head
        from tsengine.eagle3.vocab import vocab_map

        cfg = Eagle3Config.for_target(AutoConfig.from_pretrained(path), draft_vocab_size=4096)
        head = Eagle3Head(cfg)
        head.init_weights(0)
        head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, None))
        rows["eagle3-random"] = LLM(path, max_num_seqs=1, enable_prefix_caching=False, speculative_config={
            "method": "eagle3", "model": str(save_head(head, tempfile.mkdtemp())),
            "num_speculative_tokens": args.steps, "adaptive": False})
    longest = max(prompts, key=len)
    # Prefix caching is off in every row: repeats resend the same prompts, and HF pays their prefill each time.
    for llm in rows.values():  # warm-up: first calls allocate, pick kernels and compile every context bucket
        engine_row(llm, [longest], args.max_tokens)
    from tsengine.model.compile_worker import WORKER

    WORKER.wait()  # the graphs the warm-up made hot compile off the engine thread: none beside a timed round
    results: dict[str, list] = {k: [] for k in ["hf", *rows]}
    info, splits = {}, {k: [] for k in rows}
    for r in range(args.repeats):
        if not args.no_hf:
            tps, hf_out = hf_row(path, prompts, args.max_tokens)
            results["hf"].append(tps)
        for name, llm in rows.items():
            tps, outs, split, tau, steps = engine_row(llm, prompts, args.max_tokens, args.temperature)
            results[name].append(tps)
            info[name] = (outs, split, tau, steps)
            splits[name].append(split)
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in results.items() if v), flush=True)
    med = {k: statistics.median(v) for k, v in results.items() if v}
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seeded"
    print(f"\n{len(prompts)} prompts x {args.max_tokens} new tokens, batch 1, {mode}, "
          f"median of {args.repeats} (tok/s, and each share of the time split); "
          f"torch threads {torch.get_num_threads()}")
    print("| row | tok/s | vs HF | vs plain | τ | time split forward / commit / draft |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k, v in med.items():
        vs_hf = f"{v / med['hf']:.2f}x" if "hf" in med else "-"
        tau, split = (f"{info[k][2]:.2f}" if k in info and info[k][2] else "-"), "-"
        if k in info:
            s = {part: statistics.median(x[part] for x in splits[k]) for part in ("forward", "commit", "draft")}
            split = f"{s['forward']:.1%} / {s['commit']:.1%} / {s['draft']:.1%}"
        print(f"| {k} | {v:.1f} | {vs_hf} | {v / med[plain_name]:.2f}x | {tau} | {split} |")
    base = info[plain_name][0]
    for k in rows:
        if k != plain_name:
            same = sum(a == b for a, b in zip(info[k][0], base))
            print(f"{k}: {same}/{len(base)} outputs equal the plain row token for token")
    if not args.no_hf and args.temperature == 0:
        same = sum(a == b for a, b in zip(hf_out, base))
        print(f"hf: {same}/{len(base)} outputs equal the engine's plain greedy (fp32 reduction order may differ)")


if __name__ == "__main__":
    main()
