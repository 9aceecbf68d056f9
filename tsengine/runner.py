"""Everything with weights: the target decoder, the draft head, both KV caches, device and dtype.

Startup decides, once and visibly: device (cuda when present), dtype (`auto` = bf16 on GPU when the
checkpoint is 16-bit, fp32 on CPU where AVX2 has no fast bf16), attention backend (`auto` = triton on GPU,
torch on CPU), max_model_len, and the number of KV blocks from the memory budget. The head is validated
against the target (hidden size, vocab, aux layer ids) before anything runs.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoTokenizer

from tsengine import kv_cache
from tsengine.config import EngineConfig
from tsengine.errors import UserError
from tsengine.models.llama import load_model
from tsengine.targets import resolve

log = logging.getLogger("tsengine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _eos_ids(path: str, tok, hf) -> list[int]:
    from transformers import GenerationConfig

    ids = []
    try:
        g = GenerationConfig.from_pretrained(path).eos_token_id
        ids = [] if g is None else ([g] if isinstance(g, int) else list(g))
    except OSError:
        g = getattr(hf, "eos_token_id", None)
        ids = [] if g is None else ([g] if isinstance(g, int) else list(g))
    if tok.eos_token_id is not None and tok.eos_token_id not in ids:
        ids.append(tok.eos_token_id)
    return ids


def reserve_slots(spec) -> int:
    """KV positions a request holds past its tokens: a chain's verify window reaches S past the last token
    and its draft chain after a full accept writes up to 2S-1 past it; a tree's window (and the draft
    lanes inside it) reaches N-1 past it."""
    return 0 if spec is None else max(2 * spec.num_steps, spec.num_draft_tokens)


def positions_per_request(spec, max_model_len: int) -> int:
    """The most KV positions one request holds at once: the scheduler grows a verify window at the last
    allowed token (max_model_len - 1 tokens, one not yet cached) to its window plus `reserve_slots`."""
    return max_model_len + reserve_slots(spec) + (spec.num_draft_tokens - 1 if spec is not None else 0)


class Runner:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = resolve(config.model)
        try:
            hf = AutoConfig.from_pretrained(path)
            self.tokenizer = AutoTokenizer.from_pretrained(resolve(config.tokenizer) if config.tokenizer else path)
        except (OSError, ValueError) as e:
            raise UserError(f"model {config.model!r}: cannot read its config/tokenizer ({e})") from None
        self.hf_config, self.eos_ids = hf, _eos_ids(path, self.tokenizer, hf)
        self.vocab_size = hf.vocab_size
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto"
                                   else config.device)
        gpu = self.device.type == "cuda"
        if config.dtype == "auto":
            ckpt = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
            self.dtype = torch.bfloat16 if gpu and str(ckpt).endswith(("bfloat16", "float16")) else torch.float32
        else:
            self.dtype = DTYPES[config.dtype]
        self.backend = ("triton" if gpu else "torch") if config.attention_backend == "auto" else config.attention_backend
        if self.backend == "triton" and not gpu:
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise UserError("attention_backend triton needs a CUDA GPU (or TRITON_INTERPRET=1 to interpret "
                                "the kernels on the CPU, slowly); allowed here: torch")
        limit = hf.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        if config.max_model_len and config.max_model_len > limit:
            raise UserError(f"max_model_len {config.max_model_len} exceeds the model's "
                            f"max_position_embeddings {limit}")
        spec = config.speculative
        self.head = None
        aux_ids = tuple(config.capture_layer_ids or ())
        bad = [i for i in aux_ids if not 0 <= i < hf.num_hidden_layers]
        if bad:
            raise UserError(f"capture_layer_ids {list(aux_ids)}: {bad} outside 0..{hf.num_hidden_layers - 1}")
        if aux_ids and spec is not None:
            raise UserError("capture_layer_ids with speculative decoding: capture keeps plain prefill and decode "
                            "rows; run the capturing engine without speculation")
        if spec is not None and spec.algorithm == "EAGLE3":
            from tsengine.eagle3.format import load_head

            self.head = load_head(spec.draft_model_path, target=hf, device=self.device, dtype=self.dtype)
            aux_ids = self.head.config.aux_layer_ids
        from tsengine import support

        support.check(self.backend, spec, self.head.config.draft_vocab_size if self.head is not None else None)
        # RoPE rows for every position a request can touch: its verify window (and draft lanes) reach
        # reserve_slots past its last token, which may be the last allowed one
        self.model = load_model(path, hf, self.dtype, self.device, aux_ids, self.backend,
                                self.max_model_len + reserve_slots(spec))
        if self.head is not None and self.head.embed_tokens is None:
            self.head.bind_embeddings(self.model.embed)
        self._allocate(spec)

    def _allocate(self, spec) -> None:
        c, cfg = self.config, self.model.cfg
        self.block_size = c.block_size
        per = kv_cache.bytes_per_block(c.block_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                       self.dtype)
        if self.head is not None:
            h = self.head.config
            per += kv_cache.bytes_per_block(c.block_size, 1, h.num_key_value_heads, h.head_dim, self.dtype)
        held = positions_per_request(spec, self.max_model_len)
        # Rejection sampling keeps each running request's draft distributions q ([S, draft vocab] fp32) from
        # its draft step to its verify step, and verification scatters them into the target vocab.
        self.q_bytes = 0
        if spec is not None and spec.rule == "rejection" and self.head is not None:
            self.q_bytes = c.max_num_seqs * spec.num_steps * (self.head.config.draft_vocab_size + self.vocab_size) * 4
            log.info("speculative sampling: recorded draft distributions take up to %.1f MiB (max_num_seqs %d x "
                     "%d steps x (draft vocab %d + vocab %d) x 4 B), reserved before the KV cache", self.q_bytes / 2**20,
                     c.max_num_seqs, spec.num_steps, self.head.config.draft_vocab_size, self.vocab_size)
        # Capturing requests keep their target features by position (tsengine/capture.py): room for every
        # running request at full length, reserved like q.
        if c.capture_layer_ids:
            from tsengine.capture import bytes_per_position

            self.q_bytes += c.max_num_seqs * self.max_model_len * bytes_per_position(
                len(c.capture_layer_ids) * cfg.hidden_size, cfg.hidden_size, self.dtype)
        if self.device.type == "cuda":
            import gc

            gc.collect()  # an engine freed before this one (eval shapes, regeneration splits) gives its
            torch.cuda.empty_cache()  # cache back, or mem_get_info counts it as used
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - (1 - c.gpu_memory_utilization) * total) - self.q_bytes
        elif c.kv_cache_memory is not None:
            budget = c.kv_cache_memory - self.q_bytes
        else:  # enough for every request slot at full length, capped at 4 GiB
            budget = min(c.max_num_seqs * -(-held // c.block_size) * per, 4 << 30)
        if c.num_kv_blocks is not None:
            budget = c.num_kv_blocks * per
        n = kv_cache.plan_blocks(budget, per, c.block_size, held)
        self.blocks = kv_cache.BlockManager(n, c.block_size)
        self.kv_buf, self.kv = kv_cache.allocate(n, c.block_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                 cfg.head_dim, self.dtype, self.device)
        self.drafter = None
        if spec is not None and spec.algorithm == "NGRAM":
            from tsengine.spec.ngram import NgramDrafter

            self.drafter = NgramDrafter(spec.num_steps, spec.prompt_lookup_min, spec.prompt_lookup_max, self.device)
        if self.head is not None:
            from tsengine.spec.eagle3 import Eagle3Drafter

            h = self.head.config
            dkv = kv_cache.allocate(n, c.block_size, 1, h.num_key_value_heads, h.head_dim, self.dtype, self.device)[1][0]
            self.drafter = Eagle3Drafter(self.head, spec.num_steps, dkv, c.block_size, self.backend, spec.eagle_topk,
                                         spec.num_draft_tokens, spec.rule)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB incl. draft), backend %s, dtype %s, device %s",
                 n, c.block_size, n * per / 2**20, self.backend, self.dtype, self.device)
