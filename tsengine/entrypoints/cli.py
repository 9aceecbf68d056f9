"""`tsengine` command line: pull the embedded target, make and export heads, generate, serve.

User mistakes surface as one `tsengine: error: ...` line and exit code 2; see tsengine/errors.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from tsengine.config import DraftQuantization
from tsengine.entrypoints.openai.settings import ServerSettings as ServerSettingsDefaults
from tsengine.errors import UserError, run_main


def _pull(args) -> None:
    from tsengine.targets import pull

    print(pull(args.name, args.dir))


def _head_init(args) -> None:
    from transformers import AutoConfig

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.eagle3.format import save_head
    from tsengine.eagle3.head import Eagle3Head
    from tsengine.eagle3.vocab import read_token_counts, vocab_map
    from tsengine.targets import resolve

    path = resolve(args.target)
    try:
        target = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise UserError(f"--target {args.target}: cannot read its config.json ({e})") from None
    cfg = Eagle3Config.for_target(target, args.draft_vocab_size, args.aux_layer_ids, args.dtype)
    counts = read_token_counts(args.token_counts, target.vocab_size) if args.token_counts else None
    head = Eagle3Head(cfg)
    head.init_weights(args.seed)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, counts))
    print(save_head(head, args.out))


def _export(args) -> None:
    from tsengine.eagle3.export import export_checkpoint

    target = verifier = None
    if args.target:
        from transformers import AutoConfig

        from tsengine.targets import resolve

        verifier = resolve(args.target)  # an embedded name: the local directory its weights came from
        target = AutoConfig.from_pretrained(verifier)
    out = export_checkpoint(args.checkpoint, args.out, target=target, dtype=args.dtype, fmt=args.format,
                            verifier=verifier)
    print(f"exported {out}")


def _generate(args) -> None:
    import time

    from tsengine.engine.core import Engine
    from tsengine.entrypoints.engine_args import engine_config
    from tsengine.sampling_params import SamplingParams
    from tsengine.targets import encode_prompt

    engine = Engine(engine_config(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.seed_sample, ignore_eos=args.ignore_eos)
    prompt = encode_prompt(engine.tokenizer, args.prompt, raw=args.raw)
    engine.add_request("0", prompt, params)
    tokens, steps, t0 = [], 0, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_tokens
            steps += out.verify
            if args.stream:
                print(engine.tokenizer.decode(out.new_tokens, skip_special_tokens=True), end="", flush=True)
    dt = time.perf_counter() - t0
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    print(("\n" if args.stream else text + "\n"), end="")
    tau = f", tau {(len(tokens) - 1) / steps:.2f} tokens per verify step" if steps else ""
    print(f"[{len(tokens)} tokens in {dt:.2f} s, {len(tokens) / dt:.1f} tok/s{tau}]", file=sys.stderr)


def _serve(args) -> None:
    from tsengine.entrypoints.engine_args import engine_config
    from tsengine.entrypoints.openai.app import serve
    from tsengine.entrypoints.openai.settings import ServerSettings, default_model_name

    settings = ServerSettings(
        model_name=args.served_model_name or default_model_name(args.model), api_key=args.api_key,
        default_max_tokens=args.default_max_tokens, max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_request_body_bytes, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        drain_timeout_s=args.drain_timeout, sanitize_control_tokens=args.sanitize_control_tokens,
        warmup=args.warmup)
    serve(engine_config(args), settings, host=args.host, port=args.port)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _tune(args) -> None:
    from tsengine.entrypoints.tune import parse_trees, print_report, tune

    levels = _levels(args.concurrency)
    engine_kw = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    report = tune(args.model, args.draft, args.prompts, levels, args.max_tokens, args.steps, parse_trees(args.trees),
                  args.out, args.temperature, not args.no_ngram, engine_kw, args.repeats, args.draft_quantization)
    print_report(report, args.model)
    print(f"\nwritten: {args.out}/tune.json, {args.out}/tune.png")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise UserError(f"--concurrency: expected positive integers separated by commas, got {text!r}")
    return levels


def _layer_ids(text: str) -> tuple[int, int, int]:
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}") from None
    if len(ids) != 3:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer ids, got {text!r}")
    return ids


def _int_at_least(low: int, words: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {words}, got {v}")
        return v
    return parse


_positive = _int_at_least(1, "a positive integer")
_non_negative = _int_at_least(0, "an integer >= 0")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tsengine", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    pl = sub.add_parser("pull", help="make an embedded target available as a HF checkpoint directory")
    pl.add_argument("name", help="embedded target name (smollm2-135m)")
    pl.add_argument("--dir", help="checkpoint directory to create (default: the tsengine cache)")
    pl.set_defaults(run=_pull)

    hd = sub.add_parser("head", help="EAGLE-3 head utilities").add_subparsers(dest="head_command", required=True)
    hi = hd.add_parser("init", help="write an untrained (random) head for a target, in the export format")
    hi.add_argument("--target", required=True, help="target: HF directory, embedded name or hub id")
    hi.add_argument("--out", required=True, help="output directory")
    hi.add_argument("--draft-vocab-size", type=_positive, help="draft vocab size (default min(32000, vocab))")
    hi.add_argument("--token-counts", help="JSON {token_id: count}: the draft vocab is the most frequent ids")
    hi.add_argument("--aux-layer-ids", type=_layer_ids, help="three target layer ids (outputs), e.g. 1,14,26")
    hi.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    hi.add_argument("--seed", type=int, default=0)
    hi.set_defaults(run=_head_init)

    ex = sub.add_parser("export", help="write a training checkpoint's head in the SGLang/vLLM format")
    ex.add_argument("checkpoint", help="checkpoints/step-N directory, a run directory (latest checkpoint) or a "
                    "head directory in any format tsengine loads")
    ex.add_argument("--out", required=True, help="output head directory")
    ex.add_argument("--target", help="also check the head fits this target (dir, embedded name or hub id)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (default: as trained)")
    ex.add_argument("--format", default="sglang", choices=["sglang", "speculators"],
                    help="sglang: what SGLang, SpecForge and vLLM's EAGLE path read (default); speculators: "
                    "vLLM's speculators format (needs --target)")
    ex.set_defaults(run=_export)

    from tsengine.entrypoints.engine_args import add_engine_args

    gen = sub.add_parser("generate", help="generate one completion with the engine (speculative if asked)")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True, help="user message (rendered with the chat template unless --raw)")
    gen.add_argument("--raw", action="store_true", help="use the prompt as plain text, no chat template")
    gen.add_argument("--max-tokens", type=_positive, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed-sample", type=int, help="sampling seed of the request")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    gen.set_defaults(run=_generate)

    tu = sub.add_parser("tune", help="measure plain, NGRAM, EAGLE-3 chains/trees and adaptive speculation on "
                                     "your prompts; recommend `serve` flags per load")
    tu.add_argument("--model", required=True, help="target: HF directory, embedded name or hub id")
    tu.add_argument("--draft", help="EAGLE-3 head directory (without it: plain and NGRAM only)")
    tu.add_argument("--prompts", required=True, help=".txt (one raw prompt per line) or chat rows (.json/.jsonl/"
                                                     ".parquet, ShareGPT or OpenAI shape)")
    tu.add_argument("--concurrency", default="1,4,16,64", help="load levels (default 1,4,16,64)")
    tu.add_argument("--max-tokens", type=_positive, default=64, help="tokens decoded per request (default 64)")
    tu.add_argument("--steps", type=_positive, default=3, help="longest chain (and NGRAM's steps; default 3)")
    tu.add_argument("--trees", default="3x2x6", help="tree shapes STEPSxTOPKxNODES, comma-separated ('' for none)")
    tu.add_argument("--no-ngram", action="store_true", help="skip NGRAM")
    tu.add_argument("--draft-quantization", choices=get_args(DraftQuantization), default="none",
                    help="serve the head of every head configuration with its weights in bf16 or int8 (CPU fp32; "
                         "default none)")
    tu.add_argument("--repeats", type=_positive, default=3,
                    help="runs of each level; the median tok/s is reported (default 3: a shared CPU is noisy)")
    tu.add_argument("--temperature", type=float, default=0.0)
    tu.add_argument("--max-model-len", type=_positive)
    tu.add_argument("--out", default="runs/tune", help="directory for tune.json and tune.png (default runs/tune)")
    tu.set_defaults(run=_tune)

    sv = sub.add_parser("serve", help="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)")
    add_engine_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: local only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require `Authorization: Bearer KEY`")
    sv.add_argument("--served-model-name",
                    help="model id in the API (default: --model as given, or its directory name for a path)")
    d = ServerSettingsDefaults()  # the flags' defaults are the settings' own
    sv.add_argument("--default-max-tokens", type=_positive, default=d.default_max_tokens,
                    help=f"max_tokens of a request that sets none (default {d.default_max_tokens}; cut to the context)")
    sv.add_argument("--max-queue-len", type=_non_negative, default=d.max_queue_len,
                    help=f"choices that may wait beyond --max-num-seqs before requests get 429 "
                         f"(default {d.max_queue_len})")
    sv.add_argument("--max-request-body-bytes", type=_positive, default=d.max_body_bytes,
                    help=f"larger request bodies get 413 (default {d.max_body_bytes})")
    sv.add_argument("--header-timeout", type=_positive_float, default=d.header_timeout_s,
                    help=f"seconds a connection may take to send its request headers (default {d.header_timeout_s})")
    sv.add_argument("--body-timeout", type=_positive_float, default=d.body_timeout_s,
                    help=f"seconds a request may take to send its body after its headers; then 408 and the "
                         f"connection is closed (default {d.body_timeout_s})")
    sv.add_argument("--drain-timeout", type=_positive_float, default=d.drain_timeout_s,
                    help="seconds running requests may finish after SIGTERM before they end with finish_reason "
                         "'abort' (those still tokenizing get a 503 server_shutting_down) "
                         f"(default {d.drain_timeout_s}); a second signal exits at once")
    sv.add_argument("--sanitize-control-tokens", action=argparse.BooleanOptionalAction,
                    default=d.sanitize_control_tokens,
                    help="encode control-token strings inside chat messages (<|im_end|>, <|im_start|>, ...) as "
                         "plain text, so a message cannot forge a turn; --no-sanitize-control-tokens is vLLM's "
                         f"behaviour (default {'on' if d.sanitize_control_tokens else 'off'}; /v1/completions "
                         "prompts are never touched)")
    sv.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=d.warmup,
                    help="before listening, compile the step graphs a first request runs (batch 1, the configured "
                         "drafts; cached on disk under the tsengine cache, so later starts take seconds); other "
                         "shapes compile off the engine thread while their steps run eagerly "
                         f"(default {'on' if d.warmup else 'off'})")
    sv.set_defaults(run=_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    import logging

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def body() -> None:
        args.run(args)

    return run_main("tsengine", body)


if __name__ == "__main__":
    sys.exit(main())
