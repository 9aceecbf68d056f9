"""What the engine decides once, at start-up, and visibly: where it runs, in what precision, with which
attention backend, how long a context is, which head, and how many KV blocks fit.

    device     cuda when present (`auto`)
    dtype      `auto` = bf16 on GPU when the checkpoint is 16-bit; fp32 on CPU, where AVX2 has no fast bf16
    backend    `auto` = triton on GPU, torch on CPU
    context    max_model_len, at most the model's max_position_embeddings
    head       validated against the target (hidden size, vocab, aux layer ids) before anything runs
    KV blocks  from the memory budget, after what speculation and capture reserve (`plan_kv`)

Everything here is plain functions of the config; `tsengine.engine.runner.ModelRunner` holds their results.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tsengine.cache import kv_cache
from tsengine.errors import UserError

log = logging.getLogger("tsengine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reserve_slots(spec) -> int:
    """KV positions a request holds past its tokens: a chain's verify window reaches S past the last token
    and its draft chain after a full accept writes up to 2S-1 past it; a tree's window (and the draft
    lanes inside it) reaches N-1 past it."""
    return 0 if spec is None else max(2 * spec.num_steps, spec.num_draft_tokens)


def positions_per_request(spec, max_model_len: int) -> int:
    """The most KV positions one request holds at once: the scheduler grows a verify window at the last
    allowed token (max_model_len - 1 tokens, one not yet cached) to its window plus `reserve_slots`."""
    return max_model_len + reserve_slots(spec) + (spec.num_draft_tokens - 1 if spec is not None else 0)


def choose_device(config) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device)


def choose_dtype(config, hf, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    ckpt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return torch.bfloat16 if device.type == "cuda" and str(ckpt).endswith(("bfloat16", "float16")) else torch.float32


def choose_backend(config, device: torch.device) -> str:
    gpu = device.type == "cuda"
    backend = ("triton" if gpu else "torch") if config.attention_backend == "auto" else config.attention_backend
    if backend == "triton" and not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise UserError("attention_backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to interpret "
                        "the kernels on the CPU, slowly); allowed here: torch")
    return backend


def context_length(config, hf) -> int:
    limit = hf.max_position_embeddings
    if config.max_model_len and config.max_model_len > limit:
        raise UserError(f"max_model_len {config.max_model_len} exceeds the model's "
                        f"max_position_embeddings {limit}")
    return min(config.max_model_len or limit, limit)


def aux_layers(config, hf) -> tuple[int, ...]:
    """The capture layers asked for (speculation's aux layers come from its head instead)."""
    aux_ids = tuple(config.capture_layer_ids or ())
    bad = [i for i in aux_ids if not 0 <= i < hf.num_hidden_layers]
    if bad:
        raise UserError(f"capture_layer_ids {list(aux_ids)}: {bad} outside 0..{hf.num_hidden_layers - 1}")
    if aux_ids and config.speculative is not None:
        raise UserError("capture_layer_ids with speculative decoding: capture keeps plain prefill and decode "
                        "rows; run the capturing engine without speculation")
    return aux_ids


def use_graphs(config, device, backend: str) -> bool:
    """Compiled step graphs (tsengine/model/graphs.py): on by default on the CPU with the torch attention backend.
    Not on CUDA yet: the captured path is unmeasured there (no GPU has run it), so GPUs run eagerly."""
    if config.enforce_eager or os.environ.get("TSENGINE_ENFORCE_EAGER", "0") == "1":
        return False
    return device.type == "cpu" and backend == "torch"


@dataclass
class KVPlan:
    blocks: kv_cache.BlockManager
    kv: list  # the target's cache: per layer (k, v)
    draft_kv: tuple | None  # the head's one layer (k, v), same blocks
    reserved_bytes: int  # held before the KV cache: rejection sampling's q, capture buffers


def reserved_bytes(config, cfg, head, vocab_size: int, max_model_len: int, dtype) -> int:
    """Memory set aside before the KV cache is sized. Rejection sampling keeps each running request's draft
    distributions q ([S, draft vocab] fp32) from its draft step to its verify step and scatters them into the
    target vocab; capturing requests keep their features by position (tsengine/engine/capture.py), room for every
    running request at full length."""
    spec, out = config.speculative, 0
    if spec is not None and spec.rule == "rejection" and head is not None:
        out = config.max_num_seqs * spec.num_steps * (head.config.draft_vocab_size + vocab_size) * 4
        log.info("speculative sampling: recorded draft distributions take up to %.1f MiB (max_num_seqs %d x "
                 "%d steps x (draft vocab %d + vocab %d) x 4 B), reserved before the KV cache", out / 2**20,
                 config.max_num_seqs, spec.num_steps, head.config.draft_vocab_size, vocab_size)
    if config.capture_layer_ids:
        from tsengine.engine.capture import bytes_per_position

        out += config.max_num_seqs * max_model_len * bytes_per_position(
            len(config.capture_layer_ids) * cfg.hidden_size, cfg.hidden_size, dtype)
    return out


def plan_kv(config, cfg, head, vocab_size: int, max_model_len: int, dtype, device, backend: str) -> KVPlan:
    """Size and allocate both caches: the target's layers and the head's one layer share the block table."""
    c, spec = config, config.speculative
    per = kv_cache.bytes_per_block(c.block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
    if head is not None:
        h = head.config
        per += kv_cache.bytes_per_block(c.block_size, 1, h.num_key_value_heads, h.head_dim, dtype)
    held = positions_per_request(spec, max_model_len)
    reserved = reserved_bytes(c, cfg, head, vocab_size, max_model_len, dtype)
    if device.type == "cuda":
        import gc

        gc.collect()  # an engine freed before this one (eval shapes, regeneration splits) gives its
        torch.cuda.empty_cache()  # cache back, or mem_get_info counts it as used
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - (1 - c.gpu_memory_utilization) * total) - reserved
    elif c.kv_cache_memory is not None:
        budget = c.kv_cache_memory - reserved
    else:  # enough for every request slot at full length, capped at 4 GiB
        budget = min(c.max_num_seqs * -(-held // c.block_size) * per, 4 << 30)
    if c.num_kv_blocks is not None:
        budget = c.num_kv_blocks * per
    n = kv_cache.plan_blocks(budget, per, c.block_size, held)
    kv = kv_cache.allocate(n, c.block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                   dtype, device)
    draft_kv = None
    if head is not None:
        h = head.config
        draft_kv = kv_cache.allocate(n, c.block_size, 1, h.num_key_value_heads, h.head_dim, dtype, device)[0]
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB incl. draft), backend %s, dtype %s, device %s",
             n, c.block_size, n * per / 2**20, backend, dtype, device)
    return KVPlan(kv_cache.BlockManager(n, c.block_size), kv, draft_kv, reserved)
