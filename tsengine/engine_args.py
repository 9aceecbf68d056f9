"""Command-line flags for the engine, shared by `tsengine generate`, `serve` and `bench`.

Speculation flags carry SGLang/TokenSpeed names; `--speculative-config` takes vLLM's JSON form. Both go
through `SpeculativeConfig.resolve`, so a conflict between them is one clear error.
"""

from __future__ import annotations

import argparse

from tsengine.config import EngineConfig, SpeculativeConfig


def _int_in(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is out of range; allowed: {lo}..{hi if hi is not None else 'inf'}")
        return v
    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target: HF directory, embedded name (smollm2-135m) or hub id")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--block-size", type=_int_in(1, 256), default=16)
    p.add_argument("--kv-cache-memory", type=_int_in(1), help="KV cache bytes (CPU); default: enough for --max-num-seqs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=_int_in(2))
    p.add_argument("--max-num-seqs", type=_int_in(1), default=64)
    p.add_argument("--max-num-batched-tokens", type=_int_in(1), default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug-checks", action="store_true", help="run the block/scheduler invariants every step")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-algorithm", type=str.upper, choices=["EAGLE3", "NGRAM"],
                   help="EAGLE3 (a trained head) or NGRAM (prompt lookup in the request's own tokens)")
    s.add_argument("--speculative-draft-model-path", help="EAGLE-3 head directory (export format)")
    # ranges are checked together in SpeculativeConfig (one error lists every violation)
    s.add_argument("--speculative-num-steps", type=int, help="draft forwards per step (1..10)")
    s.add_argument("--speculative-eagle-topk", type=int, help="children per expansion: 1 = chain, > 1 = tree (1..16)")
    s.add_argument("--speculative-num-draft-tokens", type=int,
                   help="nodes verified per step, root included (2..64); a chain: steps + 1; required for a tree")
    s.add_argument("--enable-speculative-sampling", action="store_true", default=None,
                   help="temperature > 0: rejection sampling against the draft's q (chain, EAGLE3); the default "
                        "keyed Gumbel rule returns exactly plain sampling's tokens instead")
    s.add_argument("--spec-tree-sampling", choices=["gumbel", "multiround"],
                   help="temperature > 0 rule for trees: gumbel (default: plain sampling's tokens) or multiround "
                        "(point-mass multi-round rejection)")
    s.add_argument("--speculative-config", help='vLLM-style JSON, e.g. {"method": "eagle3", "model": DIR, '
                                                '"num_speculative_tokens": 3}')


def engine_config(args: argparse.Namespace) -> EngineConfig:
    spec = SpeculativeConfig.resolve(args.speculative_algorithm, args.speculative_draft_model_path,
                                     args.speculative_num_steps, args.speculative_eagle_topk,
                                     args.speculative_num_draft_tokens, args.speculative_config,
                                     args.enable_speculative_sampling, args.spec_tree_sampling)
    return EngineConfig.make(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        attention_backend=args.attention_backend, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
        debug_checks=args.debug_checks, speculative=spec)
