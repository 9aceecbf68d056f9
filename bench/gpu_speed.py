"""GPU timing on a random-weight target of Llama-3.1-8B's shape with a random EAGLE-3 head of the real shape:
plain vs EAGLE-3 chain vs tree, batch 1 and 32, bf16 (run by bench/gpu_check.sh on a lent GPU).

Random weights accept nothing (τ ≈ 1), so the speculative rows measure what drafting and verifying cost,
not what they gain: a verify window's price against a decode step, and the drafter's share, on real shapes.

    python bench/gpu_speed.py [--layers 32] [--batches 1,32] [--max-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False, hidden_act="silu",
                rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"})


def write_target(out: Path, layers: int) -> Path:
    """config.json, a small BPE tokenizer and random bf16 safetensors of the 8B shape (made on the GPU)."""
    from safetensors.torch import save_file

    from tests.tiny import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = {**LLAMA_8B, "num_hidden_layers": layers, "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(cfg))
    make_tokenizer(out)
    h, i, d, nh, nkv, v = (cfg[k] for k in ("hidden_size", "intermediate_size", "head_dim", "num_attention_heads",
                                             "num_key_value_heads", "vocab_size"))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()

    save_file({"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "lm_head.weight": rand(v, h)}, str(out / "model-00000.safetensors"))
    for n in range(layers):
        p = f"model.layers.{n}."
        save_file({p + "self_attn.q_proj.weight": rand(nh * d, h), p + "self_attn.k_proj.weight": rand(nkv * d, h),
                   p + "self_attn.v_proj.weight": rand(nkv * d, h), p + "self_attn.o_proj.weight": rand(h, nh * d),
                   p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                   p + "mlp.down_proj.weight": rand(h, i),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)},
                  str(out / f"model-{n + 1:05d}.safetensors"))
    return out


def write_head(target: Path, out: Path) -> Path:
    from transformers import AutoConfig

    from tsengine.eagle3.config import Eagle3Config
    from tsengine.eagle3.format import save_head
    from tsengine.eagle3.head import Eagle3Head
    from tsengine.eagle3.vocab import vocab_map

    cfg = Eagle3Config.for_target(AutoConfig.from_pretrained(target), draft_vocab_size=32000)
    head = Eagle3Head(cfg)
    head.init_weights(0)
    head.set_vocab_map(*vocab_map(cfg.vocab_size, cfg.draft_vocab_size, None))
    return save_head(head.to(torch.bfloat16), out)


def timed(llm, batch: int, n: int, repeats: int = 3) -> float:
    from tsengine.sampling_params import SamplingParams

    prompts = [[100 + (7 * b + j) % 300 for j in range(64)] for b in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        torch.cuda.synchronize()
        rates.append(batch * n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    from tsengine.entrypoints.llm import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_speed: no CUDA device (this benchmark only runs on a GPU)")
    work = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    target = write_target(work / "target", args.layers)
    head = write_head(target, work / "head")
    print(f"random 8B-shape target ({args.layers} layers) and head written in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rows = {"plain": None,
            "eagle3 chain (3,1,4)": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                     "adaptive": False},
            "eagle3 tree (5,8,32)": {"method": "eagle3", "model": str(head), "num_speculative_tokens": 5,
                                     "eagle_topk": 8, "num_draft_tokens": 32, "adaptive": False}}
    table = {}
    for name, spec in rows.items():
        llm = LLM(str(target), speculative_config=spec, dtype="bfloat16", device="cuda", max_num_seqs=64)
        table[name] = {b: timed(llm, int(b), args.max_tokens) for b in args.batches.split(",")}
        print(name, {b: round(v, 1) for b, v in table[name].items()}, flush=True)
        del llm
        torch.cuda.empty_cache()
    print("| row | " + " | ".join(f"batch {b} tok/s" for b in args.batches.split(",")) + " |")
    for name, r in table.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in r.values()) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
