"""Target features kept while the engine generates: the data of EAGLE-3 training at engine speed.

A head is trained on the target's hidden states over the target's own answers. Generating the answers
and then running the target again to dump those hidden states does the same forward twice; the engine
already computes every row a feature store needs — prompt rows in prefill chunks, answer rows in decode
steps — so a capturing request keeps them as they go by: the three aux hidden states (the residual stream
after each aux layer, HF's `hidden_states[i + 1]`), the final normed hidden state and the argmax over the
full vocab, at each position.

Which rows: position p is forwarded once the token at p is known, so a finished request has rows
0..len(tokens)-2; its last token (the stop token, or the last one `max_tokens` allowed) is sampled but
never forwarded. Training never reads that row (step k at base t reads rows up to t+1+k while predicting
token t+2+k, which must exist), so nothing is lost by not running it. A preempted request recomputes its
prefix and overwrites the same positions with the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Captured:
    aux: torch.Tensor  # [L-1, 3·H] for a request that ends with L tokens
    final: torch.Tensor  # [L-1, H], after the target's final norm
    argmax: torch.Tensor  # [L-1] long, over the full target vocab


def bytes_per_position(aux_width: int, hidden: int, dtype: torch.dtype) -> int:
    return (aux_width + hidden) * torch.finfo(dtype).bits // 8 + 8


class CaptureBuffer:
    """One request's rows, indexed by position, sized for its prompt plus `max_tokens`. Allocated when the
    request first runs, so a waiting request holds no memory (the runner reserves room for the running
    ones before it sizes the KV cache)."""

    def __init__(self, capacity: int, aux_width: int, hidden: int, dtype: torch.dtype, device):
        self.shape = (capacity, aux_width, hidden, dtype, device)
        self.aux = self.final = self.argmax = None

    def write(self, start: int, aux: torch.Tensor, final: torch.Tensor, argmax: torch.Tensor) -> None:
        if self.aux is None:
            capacity, aux_width, hidden, dtype, device = self.shape
            self.aux = torch.empty(capacity, aux_width, dtype=dtype, device=device)
            self.final = torch.empty(capacity, hidden, dtype=dtype, device=device)
            self.argmax = torch.empty(capacity, dtype=torch.long, device=device)
        end = start + aux.shape[0]
        self.aux[start:end], self.final[start:end], self.argmax[start:end] = aux, final, argmax

    def result(self, num_tokens: int) -> Captured:
        n = num_tokens - 1
        return Captured(self.aux[:n].clone(), self.final[:n].clone(), self.argmax[:n].clone())


def full_argmax(model, hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """argmax over the full vocab for rows whose logits the step did not form (prefill interiors), a chunk
    at a time so that [rows, vocab] fp32 never exists for a whole chunked prefill."""
    parts = [model.logits(hidden[s:s + chunk]).argmax(-1) for s in range(0, hidden.shape[0], chunk)]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.long)


def write_captures(model, batch, forward, drawing: list[int]) -> None:
    """Keep the rows of capturing runs at their positions. The argmax of a row that draws a token comes from
    the logits the step formed anyway (`drawing`: the flat row of each logits row); only prefill interiors
    need their own. Which rows are which is host bookkeeping (no sync); the index tensors go over without
    waiting."""
    runs = [(s, base) for s, base in zip(batch, forward.first_row) if s.seq.capture is not None]
    hidden, aux, logits = forward.hidden, forward.aux, forward.logits
    dev = hidden.device
    logit_of = {row: i for i, row in enumerate(drawing)}
    interior, last_rows, last_logits = [], [], []
    for s, base in runs:
        end = base + s.num_tokens
        last = logit_of.get(end - 1)
        interior.extend(range(base, end if last is None else end - 1))
        if last is not None:
            last_rows.append(end - 1)
            last_logits.append(last)

    def index(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long).to(dev, non_blocking=True)

    arg = torch.empty(hidden.shape[0], dtype=torch.long, device=dev)
    if interior:
        at = index(interior)
        arg[at] = full_argmax(model, hidden[at])
    if last_rows:
        arg[index(last_rows)] = logits[index(last_logits)].argmax(-1)
    for s, base in runs:
        end = base + s.num_tokens
        s.seq.capture.write(s.start, aux[base:end], hidden[base:end], arg[base:end])
