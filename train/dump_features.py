"""Stage (offline features): run the frozen target once over the prepared data and store its features.

    accelerate launch -m tsengine.train.dump_features --target smollm2-135m --data prepared/train --out features/train

Data-parallel: rank r takes examples r, r+world, ... Each shard (safetensors: aux, final, argmax, with
the sequences concatenated) is written atomically next to a small JSON naming its examples, offsets and
sha256, so a killed dump resumes by skipping every example already in a finished shard. Rank 0 then
merges the sidecars into `index.json` and prints bytes per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from tsengine.errors import UserError, run_main
from tsengine.train.features import DTYPES, INDEX, ShardWriter, TargetFeatures, sidecars
from tsengine.train.stages import MARKER, digest, is_done, read_marker


def dump(model, dataset, layer_ids, out: str | Path, key: str, dtype: str = "float32", batch_tokens: int = 8192,
         shard_tokens: int = 262144, rank: int = 0, world: int = 1, progress: bool = True) -> None:
    """This rank's share of the examples, skipping those already dumped under the same key."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = {e for m in sidecars(out, key) for e in m["examples"]}
    mine = [i for i in range(rank, len(dataset), world) if i not in done]
    mine.sort(key=lambda i: len(dataset[i]["input_ids"]))
    feats = TargetFeatures(model, layer_ids)
    writer = ShardWriter(out, key, f"shard-r{rank:03d}", dtype, shard_tokens)
    dev = next(model.parameters()).device

    bar = tqdm(total=len(mine), desc=f"dump_features[{rank}]", unit="seq", disable=not progress)
    i = 0
    while i < len(mine):
        size = lambda e: len(dataset[e]["input_ids"])  # noqa: E731
        j = i + 1  # ascending lengths: the batch's last example is its longest
        while j < len(mine) and (j - i + 1) * size(mine[j]) <= batch_tokens:
            j += 1
        longest = size(mine[j - 1])
        batch = mine[i:j]
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        att = torch.zeros(len(batch), longest, dtype=torch.long)
        for r, e in enumerate(batch):
            x = dataset[e]["input_ids"]
            ids[r, : len(x)], att[r, : len(x)] = torch.tensor(x), 1
        f = feats(ids.to(dev), att.to(dev))
        for r, e in enumerate(batch):
            n = int(att[r].sum())
            writer.add(e, f.aux[r, :n], f.final[r, :n], f.argmax[r, :n])
        bar.update(len(batch))
        i = j
    writer.flush()
    bar.close()


def finalize(out: Path, key: str, n_examples: int, info: dict) -> dict:
    """Rank 0, after every rank finished: index.json + the stage marker."""
    shards = sidecars(out, key)
    have = {e for m in shards for e in m["examples"]}
    if len(have) != n_examples:
        raise UserError(f"features {out}: {n_examples - len(have)} examples missing after the dump")
    tokens = sum(sum(m["lengths"]) for m in shards)
    size = sum((out / m["file"]).stat().st_size for m in shards)
    index = {"key": key, "tokens": tokens, "bytes": size, "bytes_per_token": round(size / max(tokens, 1), 1),
             "shards": shards, **info}
    (out / INDEX).write_text(json.dumps(index))
    (out / MARKER).write_text(json.dumps({"key": key, "tokens": tokens, "bytes_per_token": index["bytes_per_token"]}))
    return index


def run(model, dataset, prepared: Path, layer_ids, out: Path, dtype: str, batch_tokens: int, shard_tokens: int,
        state=None, target_name: str = "", quiet: bool = False) -> Path:
    """Whole stage under `accelerate` (or one process): skip if done, dump this rank's share, merge."""
    from accelerate import PartialState

    state = state or PartialState(cpu=not torch.cuda.is_available())
    marker = read_marker(prepared)
    key = digest(marker["key"] if marker else str(prepared), target_name, list(layer_ids), dtype)
    if is_done(out, key):
        return out
    dump(model, dataset, layer_ids, out, key, dtype, batch_tokens, shard_tokens, state.process_index,
         state.num_processes, progress=state.is_local_main_process and not quiet)
    state.wait_for_everyone()
    if state.is_main_process:
        index = finalize(out, key, len(dataset), {"dtype": dtype, "layer_ids": list(layer_ids)})
        if not quiet:
            print(f"dump_features: {index['tokens']} tokens in {len(index['shards'])} shards, "
                  f"{index['bytes_per_token']} bytes/token -> {out}")
    state.wait_for_everyone()
    return out


def main(argv: list[str] | None = None) -> int:
    from tsengine.train.threads import use_machine_cores  # first: before torch's thread pool sizes itself
    use_machine_cores()
    p = argparse.ArgumentParser(prog="accelerate launch -m tsengine.train.dump_features",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, help="prepared data directory (python -m tsengine.train.prepare_data)")
    p.add_argument("--out", required=True)
    p.add_argument("--aux-layer-ids", help="three layer ids, e.g. 1,14,26 (default: EAGLE-3's low/mid/high)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--shard-tokens", type=int, default=262144)
    args = p.parse_args(argv)

    def body() -> None:
        from accelerate import PartialState

        from tsengine.eagle3.config import default_aux_layer_ids
        from tsengine.targets import load_target
        from tsengine.train.prepare_data import load_prepared

        state = PartialState(cpu=not torch.cuda.is_available())
        model, _ = load_target(args.target, device=str(state.device))
        ids = (tuple(int(x) for x in args.aux_layer_ids.split(",")) if args.aux_layer_ids
               else default_aux_layer_ids(model.config.num_hidden_layers))
        run(model, load_prepared(args.data), Path(args.data), ids, Path(args.out), args.dtype, args.batch_tokens,
            args.shard_tokens, state, target_name=args.target)

    return run_main("dump_features", body)


if __name__ == "__main__":
    sys.exit(main())
