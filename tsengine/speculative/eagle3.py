"""The EAGLE-3 proposer: chain or tree drafting over the paged draft cache, batched across requests.

Position bookkeeping (the same as infer/reference.py): the head's input at draft position t is
(embedding of token t+1, target features of position t), so after the target has cached positions
[a, b) the head extends its own cache over [a, b) with tokens a+1..b. Token b is the next *prompt* token
when [a, b) is a non-final prefill chunk (the chunk-boundary case vLLM and SGLang both once got wrong:
tests/engine/test_engine.py::test_chunked_prefill_eagle) and the freshly sampled token otherwise. The last
extended row then starts the chain: step k feeds (draft k-1, the head's own output) at the next position.

With eagle_topk K > 1 the head grows an EAGLE-2 dynamic tree instead (`tsengine/speculative/tree.py`): the
root's K best children, then S-1 expansions of the K best frontier nodes, each fed at position
root + depth into its own lane of the draft cache, seeing the prefix and its ancestors' lanes.

Draft choices depend on the verification rule (`SpeculativeConfig.rule`) for sampled rows:
  gumbel      the same keyed Gumbel noise as the target's draw at that position (restricted to the draft
              vocab), so when the draft's distribution is close to the target's, the draft picks the very
              token the target will sample;
  rejection   a sample from q = the draft's filtered softmax(logits / T), with the drafter's own noise
              stream, and q itself is returned for verification;
  multiround  the tree ranks by the unperturbed log-probabilities (the likeliest children first).
Greedy rows take the plain argmax. Either way only the target decides.
"""

from __future__ import annotations

import torch

from tsengine.eagle3.head import Eagle3Head
from tsengine.model.attention import paged_attention, write_kv
from tsengine.model.context import Context
from tsengine.model.linear import accelerate
from tsengine.sample.sampling import RowParams, filtered_logprobs, gumbel
from tsengine.speculative.chain_kv import ChainKV
from tsengine.speculative.drafts import Drafts, Proposal, Proposer
from tsengine.speculative.tree import Tree, TreeBuilder


class Eagle3Proposer(Proposer):
    def __init__(self, head: Eagle3Head, *, num_steps: int, kv, block_size: int, backend: str, topk: int = 1,
                 num_nodes: int | None = None, rule: str = "gumbel", quantization: str = "none"):
        self.head = accelerate(head, quantization)
        self.steps, self.kv, self.block_size, self.backend = num_steps, kv, block_size, backend
        self.topk, self.num_nodes, self.rule = topk, num_nodes or num_steps + 1, rule
        self.scale = head.config.head_dim ** -0.5
        self.draft_ids_in_target = head.to_target(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
        self.graphs = None  # DraftGraphs (draft_graphs.py): greedy drafting (and, opt-in, extension), compiled
        # whether the last `propose` extended and drafted through one compiled graph; None: no graphs at all
        self.drafted_in_graph: bool | None = None

    def propose(self, proposal: Proposal, steps: int | None = None, tree: tuple[int, int, int] | None = None,
                only: list[bool] | None = None) -> list[Drafts | None]:
        """Extend the draft cache over each run's committed positions with the target features of the rows
        that produced them (a verify window's accepted path, or a prefill chunk's tokens), then draft for
        the runs that reached their last token. The configured shape unless told (adaptive speculation
        chooses per step): a chain of `steps` tokens (0: extend only), or a `tree` (S, K, N); `only`, one
        flag per `proposal.drafting` request, drafts for the flagged ones (the rest get None)."""
        if steps is None and tree is None:
            steps, tree = (self.steps, None) if self.topk == 1 else (None, (self.steps, self.topk, self.num_nodes))
        runs, rows, ids, last, need = [], [], [], [], []
        flags = iter(only) if only is not None else None
        for c in proposal.runs:
            seq, n = c.seq, len(c.rows)
            runs.append((seq.table, c.start, n))
            rows.extend(c.rows)
            ids.extend(seq.tokens[c.start + 1:c.start + n + 1])
            if c.drafts_next and (flags is None or next(flags)):
                last.append(len(rows) - 1)
                need.append(seq)
        if not runs:
            return []
        if not (steps or tree):
            last, need = [], []
        dev = proposal.aux.device
        long = dict(dtype=torch.long, device=dev)
        one_graph = (bool(need) and tree is None and all(q.params.greedy for q in need) and len(need) == len(runs)
                     and self.graphs is not None and self.graphs.fits(runs))  # every request drafts greedily
        out = None
        if one_graph:  # one graph, or None: not hot / no fit
            chain = self.graphs.extend_and_chain(runs, ids, proposal.aux, steps, rows)
            out = (chain, None) if chain is not None else None
        self.drafted_in_graph = out is not None if self.graphs is not None else None
        if out is None:
            out, positions = self._extend(runs, ids, proposal.aux[torch.tensor(rows, **long)])
            if need:
                rp = RowParams.build([q.params for q in need], [q.seed for q in need], dev)
                width = max(len(q.table) for q in need)
                tables = torch.tensor([q.table + [0] * (width - len(q.table)) for q in need], dtype=torch.long).to(dev)
                last = torch.tensor(last, **long)
                out = self._draft(out[last], positions[last], tables, rp, steps, tree, chain_graph=not one_graph)
        for c in proposal.runs:  # the head's KV now covers these runs, where it covered what came before
            if c.seq.draft_cached == c.start:
                c.seq.draft_cached = c.start + len(c.rows)
        if not need:
            return []
        if isinstance(out, Tree):
            drafts = [Drafts(out.tokens[j, 1:], tree=Tree(None, out.parents[j], out.depths[j], out.ancestors[j]))
                      for j in range(len(need))]
        else:
            tokens, q = out
            # q is cloned: a view would keep the whole batch's [D, S, vocab] alive past this request's verify
            drafts = [Drafts(tokens[j], q=q[j].clone() if q is not None else None,
                             q_ids=self.draft_ids_in_target if q is not None else None) for j in range(len(need))]
        if only is None:
            return drafts
        it = iter(drafts)
        return [next(it) if flag else None for flag in only]

    def _layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: Context | None = None,
               chain: ChainKV | None = None) -> torch.Tensor:
        """One pass of the head's layer over flat tokens at `positions`: [T] ids, [T, H] hidden -> [T, H]
        pre-norm out. Its KV goes to the paged draft cache (`ctx`), or stays with a greedy `chain`."""
        h = self.head
        emb = h.embed(ids).to(hidden.dtype)[None]
        cos, sin = h.rope(positions[None], hidden[None])
        q, k, v = (x[0].transpose(0, 1) for x in h.midlayer.qkv(emb, hidden[None], cos, sin))  # [T, heads, d]
        if chain is not None:
            a = chain.attend(q, k, v, self.scale)
        else:
            write_kv(self.kv[0], self.kv[1], k, v, ctx)
            a = paged_attention(q, self.kv[0], self.kv[1], ctx, self.scale, self.backend)
        return h.finish(a.transpose(0, 1)[None], hidden[None])[0]

    def chain_kv(self, tables: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> ChainKV:
        return ChainKV(self.kv[0], self.kv[1], tables, pos, self.block_size, dtype)

    def greedy_chain(self, hidden: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, steps: int) -> torch.Tensor:
        """[D, steps] greedy drafts (target ids) from the head's outputs `hidden` [D, H] at the requests' last
        extended rows, draft positions `pos` [D]: the chain `_draft` runs for all-greedy rows, and the part of
        a compiled draft graph after the extension (tsengine/model/graphs.py)."""
        def pick(out):
            return self.draft_ids_in_target[self.head.logits(out).float().argmax(-1)]

        drafts = [pick(hidden)]
        chain = self.chain_kv(tables, pos, hidden.dtype) if steps > 1 else None
        for s in range(1, steps):
            hidden = self._layer(drafts[-1], hidden, pos + s, chain=chain)
            drafts.append(pick(hidden))
        return torch.stack(drafts, dim=1)

    def _ranking(self, logits: torch.Tensor, rp: RowParams, positions: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """What the drafter ranks its candidates by: the raw logits for greedy rows; for sampled rows
        logits / T plus the target's own noise at `positions`, so the target's likely draw ranks first (the
        multiround rule: not perturbed). `rp`/`positions` describe D requests; `logits` holds `repeat`
        consecutive rows of each (a tree step's K frontier nodes share their position, so the noise is
        hashed once per request)."""
        if rp.all_greedy:
            return logits
        t = torch.where(rp.temperature > 0, rp.temperature, torch.ones_like(rp.temperature)).repeat_interleave(repeat)
        scaled = logits / t[:, None]
        if self.rule != "multiround":
            noise = gumbel(rp.seeds, positions, self.head.config.vocab_size)[:, self.draft_ids_in_target]
            scaled = scaled + noise.repeat_interleave(repeat, dim=0)
        sampled = (rp.temperature > 0).repeat_interleave(repeat)
        return torch.where(sampled[:, None], scaled, logits)

    def _choose(self, out: torch.Tensor, rp: RowParams, positions: torch.Tensor):
        """Target ids of the drafted tokens at `positions` (absolute position of each drafted token), and
        for the rejection rule their distribution q over the draft vocab (else None)."""
        logits = self.head.logits(out).float()
        if self.rule == "rejection" and not rp.all_greedy:
            logq = filtered_logprobs(logits, rp)
            noisy = logq + gumbel(rp.seeds, positions, logits.shape[-1], stream=1)
            pick = torch.where(rp.temperature[:, None] > 0, noisy, logits).argmax(-1)
            return self.draft_ids_in_target[pick], logq.exp()
        return self.draft_ids_in_target[self._ranking(logits, rp, positions).argmax(-1)], None

    def _scores(self, out: torch.Tensor, rp: RowParams, positions: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """Tree ranking scores over the draft vocab: log-softmax of `_ranking`."""
        return torch.log_softmax(self._ranking(self.head.logits(out).float(), rp, positions, repeat), dim=-1)

    def _tree(self, hidden: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, rp: RowParams,
              shape: tuple[int, int, int]) -> Tree:
        """EAGLE-2 tree of `shape` (S, K, N) from the root rows `hidden` [D, H] at draft positions `pos` [D]:
        node at depth d is fed at pos + d, into lane (d-1)·K + j at KV index pos + 1 + lane; its children are
        drawn at pos + 2 + d."""
        (d, h), dev = hidden.shape, hidden.device
        steps, k, nodes = shape
        tb = TreeBuilder(d, k, steps, nodes, dev)
        tb.root(self._scores(hidden, rp, pos + 2))
        parent_out = hidden[:, None].expand(d, k, h)
        lane = torch.arange(k, device=dev)
        for s in range(1, steps):
            ctx = Context.lanes(tables, (pos + s)[:, None].expand(d, k), (pos + 1)[:, None] + (s - 1) * k + lane,
                                pos + 1, tb.frontier_lane_bits(), self.block_size)
            ids = self.draft_ids_in_target[tb.frontier_tokens()].flatten()
            out = self._layer(ids, parent_out.reshape(d * k, h), ctx.positions, ctx).view(d, k, h)
            fed = tb.expand(self._scores(out.flatten(0, 1), rp, pos + 2 + s, repeat=k).view(d, k, -1))
            parent_out = out.gather(1, fed[..., None].expand(d, k, h))
        tree, _ = tb.finish()
        tree.tokens = self.draft_ids_in_target[tree.tokens]
        return tree

    def _extend(self, runs: list[tuple[list[int], int, int]], ids: list[int], aux: torch.Tensor):
        """The head's layer over the runs' committed rows (fed `ids` and the target's features `aux`), writing
        its KV: ([T, H] outputs, [T] draft positions). Through a compiled graph where the runs fit one."""
        out = self.graphs.extend(runs, ids, aux) if self.graphs is not None else None
        if out is not None:
            positions = [start + r for _, start, n in runs for r in range(n)]
            return out, torch.tensor(positions, dtype=torch.long).to(aux.device)
        ctx = Context.build(runs, self.block_size, aux.device)
        ids = torch.tensor(ids, dtype=torch.long, device=aux.device)
        return self._layer(ids, self.head.project(aux.to(self.head.fc.weight.dtype)), ctx.positions, ctx), ctx.positions

    def _draft(self, hidden: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, rp: RowParams,
               steps: int | None, tree: tuple[int, int, int] | None, chain_graph: bool = True):
        """Draft `steps` tokens (or a `tree` of shape (S, K, N)) from the head's outputs `hidden` [D, H] at the
        requests' last extended rows, at draft positions `pos` [D] (block tables `tables` [D, M], sampling
        rows `rp`; `chain_graph` False: not the chain-only graph, the step warms the one-graph draft instead).
        Returns a chain as ([D, steps] target ids, [D, steps, draft vocab] q or None), or a
        `Tree` of target ids."""
        if tree is not None:
            return self._tree(hidden, pos, tables, rp, tree)
        if rp.all_greedy:
            use_graph = chain_graph and steps > 1 and self.graphs is not None  # one step is only an argmax
            chain = self.graphs.chain(steps, hidden, pos, tables) if use_graph else None
            return (chain if chain is not None else self.greedy_chain(hidden, pos, tables, steps)), None
        first, q = self._choose(hidden, rp, pos + 2)  # pos: the chain's first input; it drafts token pos + 2
        drafts, qs = [first], [q]
        chain = self.chain_kv(tables, pos, hidden.dtype) if steps > 1 else None
        for _ in range(1, steps):
            pos = pos + 1
            hidden = self._layer(drafts[-1], hidden, pos, chain=chain)
            d, q = self._choose(hidden, rp, pos + 2)
            drafts.append(d)
            qs.append(q)
        return torch.stack(drafts, dim=1), (torch.stack(qs, dim=1) if qs[0] is not None else None)
