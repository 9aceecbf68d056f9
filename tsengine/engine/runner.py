"""All device work of the target: its weights, its KV cache, and one forward per step.

`run(batch)` lays the step's scheduled runs out as one flat batch (prefill chunks, plain decodes and verify
windows [last token, d1..dN-1] mixed), forwards the target once and forms logits only for the rows that
draw a token: the last row of a run that reaches its request's last token, every row of a verify window.
What start-up decides (device, dtype, backend, context, head, KV blocks) is in `tsengine/engine/startup.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoTokenizer

from tsengine.config import EngineConfig
from tsengine.engine import compatibility, startup
from tsengine.engine.capture import write_captures
from tsengine.engine.scheduler import Scheduled
from tsengine.errors import UserError
from tsengine.model.context import Context
from tsengine.model.llama import load_model
from tsengine.speculative import load_draft_model
from tsengine.speculative.drafts import DraftResources, Windows
from tsengine.targets import eos_ids, resolve


@dataclass(kw_only=True)
class Forward:
    """One target forward over a step's runs."""

    hidden: torch.Tensor  # [T, H] final normed hidden state of every flat row
    aux: torch.Tensor | None  # [T, A] the aux layers' hidden states (the head's input), or None
    logits: torch.Tensor  # [R, V] the rows that draw a token, run by run
    draw_positions: torch.Tensor  # [R] the position each of those rows draws (its own position + 1)
    first_row: list[int]  # each run's first row in the flat batch
    windows: Windows | None  # the step's verify windows, or None
    graph: bool = False  # it ran through a compiled graph (not eagerly)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        path = self.model_path = resolve(config.model)
        try:
            hf = AutoConfig.from_pretrained(path)
            self.tokenizer = AutoTokenizer.from_pretrained(resolve(config.tokenizer) if config.tokenizer else path)
        except (OSError, ValueError) as e:
            raise UserError(f"model {config.model!r}: cannot read its config/tokenizer ({e})") from None
        self.hf_config, self.eos_ids, self.vocab_size = hf, eos_ids(path, self.tokenizer), hf.vocab_size
        self.device = startup.choose_device(config)
        self.dtype = startup.choose_dtype(config, hf, self.device)
        self.backend = startup.choose_backend(config, self.device)
        self.max_model_len = startup.context_length(config, hf)
        spec = config.speculative
        # the method's draft model, if it has one (its own KV layer, fed by the target's aux layers)
        self.head = load_draft_model(spec, hf, self.device, self.dtype)
        aux_ids = self.head.config.aux_layer_ids if self.head is not None else startup.aux_layers(config, hf)
        compatibility.check(self.backend, spec, self.head.config.draft_vocab_size if self.head is not None else None,
                            self.device, self.dtype)
        # RoPE rows for every position a request can touch: its verify window (and draft lanes) reach
        # reserve_slots past its last token, which may be the last allowed one
        self.model = load_model(path, hf, self.dtype, self.device, aux_ids, self.backend,
                                self.max_model_len + startup.reserve_slots(spec))
        if self.head is not None and self.head.embed_tokens is None:
            self.head.bind_embeddings(self.model.embed)
        self.block_size = config.block_size
        plan = startup.plan_kv(config, self.model.cfg, self.head, self.vocab_size, self.max_model_len, self.dtype,
                               self.device, self.backend)
        self.blocks, self.kv, self.draft_kv, self.q_bytes = plan.blocks, plan.kv, plan.draft_kv, plan.reserved_bytes
        self.compiled = None
        if startup.use_graphs(config, self.device, self.backend):
            from tsengine.model.graphs import CompiledSteps

            self.compiled = CompiledSteps(self.model, self.kv, self.block_size,
                                          self.max_model_len + startup.reserve_slots(spec))

    def draft_resources(self) -> DraftResources:
        """What a proposer drafts with: the head and its KV layer, laid out as the target's cache, and the
        compiled graphs' buckets and heat when graphs are on."""
        graphs = self.compiled
        return DraftResources(head=self.head, kv=self.draft_kv, block_size=self.block_size, backend=self.backend,
                              device=self.device, graph_contexts=graphs.contexts if graphs else None,
                              graph_heat=graphs.heat if graphs else None,
                              prefix_caching=self.config.enable_prefix_caching)

    def run(self, batch: list[Scheduled]) -> Forward:
        """One forward over the batch. Host bookkeeping only: no sync, the inputs go over without waiting."""
        dev = self.device
        ids, runs, first_row, drawing = [], [], [], []  # drawing: flat rows whose logits are formed
        verify = []  # (run, its first flat row, its first logits row) per verify window
        for s in batch:
            seq, base = s.seq, len(ids)
            first_row.append(base)
            runs.append((seq.table, s.start, s.num_tokens))
            if s.verify:  # node 0 is the last committed token; the drafts are scattered in on the device
                ids.extend([seq.tokens[-1]] + [0] * (s.num_tokens - 1))
                verify.append((s, base, len(drawing)))
            else:
                ids.extend(seq.tokens[s.start:s.start + s.num_tokens])
            if s.samples:
                drawing.extend(range(base if s.verify else base + s.num_tokens - 1, base + s.num_tokens))
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        ctx = Context.build(runs, self.block_size, dev)
        windows = Windows.stack(verify, dev) if verify else None
        if windows is not None:
            input_ids[windows.flat_rows[:, 1:]] = windows.tokens
            if windows.is_tree:  # position follows depth (RoPE and draws), slot follows node index
                ctx.set_trees(windows.flat_rows, windows.starts, windows.depths, windows.ancestors)
        rows = torch.tensor(drawing, dtype=torch.long).to(dev, non_blocking=True)
        shape = self.compiled.shape_for(batch, ctx, windows is not None and windows.is_tree) if self.compiled else None
        # a decode or verify step of one shape: its compiled graph once ready (every row draws), else eager
        graphed = self.compiled.forward(shape, input_ids, ctx) if shape is not None else None
        if graphed is not None:
            hidden, aux, logits = graphed
            logits = logits[rows]
        else:
            hidden, aux = self.model(input_ids, ctx, self.kv)
            logits = self.model.logits(hidden[rows])
        forward = Forward(hidden=hidden, aux=aux, logits=logits, draw_positions=ctx.positions[rows] + 1,
                          first_row=first_row, windows=windows, graph=graphed is not None)
        if any(s.seq.capture is not None for s in batch):
            write_captures(self.model, batch, forward, drawing)
        return forward
