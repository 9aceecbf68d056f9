"""Where a `tsengine serve` process's memory goes (issue 43, item 10): a measured breakdown of its RSS.

Why: a default server on the 135M SmolLM2 holds ~6.5 GB resident, and a 24 GiB box may also run a training
recipe. The 4 GiB KV default explains most of it; this script says where the rest goes, from the kernel's
own page accounting, so a change of default is argued from numbers (docs/reliability.md, "Memory").

How:
1. An accounting child (this script with `--account`) builds the same engine in-process from the same
   serve flags, with a KV cache of one request only, and reports what the engine knows: its bytes per KV
   block; its weights per copy by summing tensor sizes (the module's fp32 parameters, the few-row kernel's
   panels, a fused head's stacked copies); oneDNN's packed copies, whose opaque tensors have no size, by the
   RSS they give back when dropped (glibc's mmap threshold is pinned at 128 KiB there, so every tensor is
   its own mapping and freeing it returns its pages); the RoPE tables; and the RSS of the interpreter,
   imports and tokenizer before the engine is built. `--check-unread` also generates greedily before and
   after filling the target's fp32 Linear parameters with NaN (eager steps): equal tokens mean the serving
   path never reads that copy.
2. It starts `tsengine serve` with the given flags, waits for /health, and reads /proc/PID/status and
   /proc/PID/smaps: when ready; after two eager requests (a short prompt and a ~300-token one, 2 tokens
   each: no graph is hot yet); and after each `--concurrency` level of 32-token requests, which makes that
   batch's decode graph hot, so it compiles (or loads from torch's FX cache: the log says which step graphs
   were compiled and how long each took).
3. Mappings are grouped (file-backed: libtorch_cpu, which links MKL and oneDNN in; other torch libraries;
   triton; compiled graph code from the inductor cache; the rows_linear kernel; Python and its extension
   modules; system libraries. Anonymous: glibc's main heap, its per-thread arenas (64 MiB-aligned heaps),
   thread stacks (a mapping above a guard page), the main stack, everything else), and the anonymous total
   is attributed to the engine's own numbers, the rest left as "rest" rather than guessed.

    nice -n 19 env OMP_NUM_THREADS=1 python bench/server_memory.py --check-unread      # the default server
    nice -n 19 env OMP_NUM_THREADS=1 python bench/server_memory.py --check-unread \\
        -- --speculative-config '{"method": "eagle3", "model": "/tmp/hour/export", "num_speculative_tokens": 3}'

Everything after `--` goes to `tsengine serve` (default: `--model smollm2-135m`, nothing else). The server
inherits the environment: without OMP_NUM_THREADS it uses torch's default thread count (the CPU's cores).
`--json OUT` writes every number. Only one server runs, on a free port, and is stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB = 2**20
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
ARENA = 64 * MiB  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heap is a 64 MiB-aligned 64 MiB reservation
SHORT = "The capital of France is"
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)  # ~300 tokens: a prefill chunk (packed path)


# ---- /proc -------------------------------------------------------------------------------------------
def status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile, RssShmem in bytes, and Threads."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


def smaps(pid: int) -> list[dict]:
    """Every mapping: start, end, perms, path ('' when anonymous), and its Rss/Pss/Anonymous in bytes."""
    maps, head = [], re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = head.match(line)
        if m:
            maps.append({"start": int(m[1], 16), "end": int(m[2], 16), "perms": m[3], "path": m[4].strip()})
            continue
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss", "Anonymous") and maps:
            maps[-1][key] = int(value.split()[0]) * 1024
    return maps


FILE_GROUPS = (  # (name, test on the path), first match wins
    ("compiled graph code (inductor cache .so)", lambda p: "torchinductor" in p),
    ("rows_linear kernel (.so)", lambda p: "torch_extensions" in p or "tsengine_rows_linear" in p),
    ("libtorch_cpu.so (incl. MKL, oneDNN)", lambda p: p.endswith("libtorch_cpu.so")),
    ("other torch libraries", lambda p: "/torch/" in p or "/torch.libs/" in p),
    ("triton (imported by inductor)", lambda p: "/triton/" in p),
    ("Python and extension modules", lambda p: "site-packages" in p or "python3" in p or "libpython" in p),
    ("system libraries", lambda p: p.startswith(("/usr/lib", "/lib"))),
    ("other files", lambda p: True),
)
ANON_GROUPS = ("glibc main heap [heap]", "glibc thread arenas", "thread stacks", "main stack [stack]",
               "other anonymous (tensors, Python objects, ...)")


def group(maps: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """(file-backed RSS per group, anonymous RSS per group). Anonymous RSS of a private file mapping
    (relocations, a .so's .data written to) counts as anonymous, as the kernel's RssAnon does."""
    files = {name: 0 for name, _ in FILE_GROUPS}
    anon = {name: 0 for name in ANON_GROUPS}
    for i, m in enumerate(maps):
        rss, an = m.get("Rss", 0), m.get("Anonymous", 0)
        path = m["path"]
        if path.startswith("/"):
            files[next(name for name, test in FILE_GROUPS if test(path))] += rss - an
            anon[ANON_GROUPS[-1]] += an
            continue
        prev = maps[i - 1] if i else None
        nxt = maps[i + 1] if i + 1 < len(maps) else None
        size = m["end"] - m["start"]
        if path == "[heap]":
            kind = ANON_GROUPS[0]
        elif path == "[stack]":
            kind = ANON_GROUPS[3]
        elif path.startswith("["):  # [vvar], [vdso], [vsyscall]
            kind = ANON_GROUPS[-1]
        elif (m["start"] % ARENA == 0 and "rw" in m["perms"] and nxt is not None and nxt["start"] == m["end"]
              and nxt["perms"].startswith("---") and not nxt["path"] and nxt["end"] - m["start"] == ARENA):
            kind = ANON_GROUPS[1]
        elif (prev is not None and prev["end"] == m["start"] and prev["perms"].startswith("---")
              and not prev["path"] and prev["end"] - prev["start"] <= 64 * 1024 and MiB <= size <= 16 * MiB):
            kind = ANON_GROUPS[2]  # a pthread stack: a guard page, then the stack (8 MiB by default)
        else:
            kind = ANON_GROUPS[-1]
        anon[kind] += rss
    return files, anon


# ---- the accounting child ----------------------------------------------------------------------------
def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_mkldnn:
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def account(serve_args: list[str], check_unread: bool) -> dict:
    """What the engine holds, built from the same flags with a one-request KV cache (see the docstring)."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # before torch allocates anything
    start = status()
    import gc
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # gc.get_objects() touches torch's deprecated aliases

    import torch
    import uvicorn  # noqa: F401  what the server imports
    from transformers import AutoConfig, AutoTokenizer

    import tsengine.entrypoints.openai.app  # noqa: F401
    from tsengine.engine import startup
    from tsengine.engine.core import Engine
    from tsengine.entrypoints.cli import parser
    from tsengine.entrypoints.engine_args import engine_config
    from tsengine.model.linear import Linear
    from tsengine.sampling_params import SamplingParams
    from tsengine.targets import resolve

    config = engine_config(parser().parse_args(["serve", *serve_args]))
    tokenizer = AutoTokenizer.from_pretrained(resolve(config.tokenizer or config.model))  # the server holds one
    imports = status()
    hf = AutoConfig.from_pretrained(resolve(config.model))
    positions = startup.positions_per_request(config.speculative, startup.context_length(config, hf))
    blocks = -(-positions // config.block_size) + 1
    engine = Engine(config.model_copy(update={"num_kv_blocks": blocks, "enforce_eager": True}))
    built = status()
    runner = engine.runner
    kv = [t for pair in runner.kv for t in pair] + list(runner.draft_kv or ())
    per_block = sum(t.nbytes for t in kv) // (blocks + 1)  # kv_cache.allocate adds one scratch block
    model, head = runner.model, runner.head
    target_linears = {id(x) for layer in model.layers for x in layer.fast.values()} | {id(model.head_linear)}
    linears = [o for o in gc.get_objects() if isinstance(o, Linear)]
    params_ptrs = {p.untyped_storage().data_ptr() for m in (model, head) if m is not None for p in m.parameters()}
    target_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {"blocks_in_child": blocks, "kv_bytes_per_block": per_block,
           "anon_start": start["RssAnon"], "anon_imports": imports["RssAnon"], "anon_engine": built["RssAnon"],
           "file_imports": imports["RssFile"], "kv_child_bytes": sum(t.nbytes for t in kv),
           "rope": model._cos.nbytes + model._sin.nbytes,
           "target_linear_params": sum(getattr(layer, n).nbytes for layer in model.layers
                                       for n in ("qkv", "o", "gate_up", "down"))}
    for who, mod, mine in (("target", model, lambda x: id(x) in target_linears),
                           ("head", head, lambda x: id(x) not in target_linears)):
        if mod is None:
            continue
        lins = [x for x in linears if mine(x)]
        out[f"{who}_params"] = _unique_bytes(p for p in mod.parameters()  # the head's bound embedding is the target's
                                             if who == "target" or p.untyped_storage().data_ptr() not in target_ptrs)
        out[f"{who}_panels"] = sum(x.panels.nbytes for x in lins if x.panels is not None)
        out[f"{who}_stored"] = _unique_bytes(t for x in lins for t in (x.qweight, x.scale)
                                             if t is not None and (x.panels is None
                                                                   or t.data_ptr() != x.panels.data_ptr()))
        out[f"{who}_stacked"] = _unique_bytes(x.weight for x in lins
                                              if x.weight.untyped_storage().data_ptr() not in params_ptrs)
        out[f"{who}_linears"] = len(lins)
        out[f"{who}_packed_count"] = sum(x.packed is not None for x in lins)
    if check_unread:
        out["unread_check"] = _check_unread(engine, model, SamplingParams, torch)
    # oneDNN's packed weights are opaque: their size is the RSS given back when they go (then the panels', whose
    # size is known, as a check that a drop measures a tensor's bytes)
    for who in ("target", "head"):
        lins = [x for x in linears if (id(x) in target_linears) == (who == "target")]
        if not lins or (who == "head" and head is None):
            continue
        before = status()["RssAnon"]
        for x in lins:
            x.packed = None
        gc.collect()
        out[f"{who}_packed"] = before - status()["RssAnon"]
        before = status()["RssAnon"]
        for x in lins:
            x.panels = None
        gc.collect()
        out[f"{who}_panels_rss_drop"] = before - status()["RssAnon"]
    del tokenizer
    return out


def _check_unread(engine, model, SamplingParams, torch) -> dict:
    """Greedy tokens of a prefill chunk (packed path) and decode steps (panels), before and after the target's
    fp32 Linear parameters (not the embedding, which the tied lm_head and the lookup read) are set to NaN."""
    tok = engine.tokenizer
    prompts = [tok(SHORT)["input_ids"], tok(LONG)["input_ids"]]
    count = iter(range(10**6))

    def run() -> list[list[int]]:
        ids = []
        for p in prompts:
            rid = f"check-{next(count)}"
            ids.append(rid)
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        got = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for o in engine.step():
                got[o.request_id].extend(o.new_tokens)
        return [got[r] for r in ids]

    clean = run()
    with torch.no_grad():
        for layer in model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                getattr(layer, name).fill_(float("nan"))
    poisoned = run()
    return {"prompt_tokens": [len(p) for p in prompts], "same_tokens": clean == poisoned,
            "clean": clean, "poisoned": poisoned}


# ---- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def complete(url: str, prompt: str, max_tokens: int) -> None:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", timeout=600, json=body)
    if r.status_code != 200:
        raise SystemExit(f"request failed: {r.status_code} {r.text[:300]}")


def snapshot(pid: int, name: str, log: Path) -> dict:
    text = log.read_text(errors="replace")
    files, anon = group(smaps(pid))
    return {"phase": name, "status": status(pid), "files": files, "anon": anon,
            "graphs": re.findall(r"compiled the (.+?) graph in ([\d.]+) s", text)}


def serve_and_measure(serve_args: list[str], levels: list[int], log: Path) -> tuple[list[dict], dict]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "tsengine.entrypoints.cli", "serve", *serve_args, "--port", str(port),
           "--served-model-name", "m"]
    print("server:", " ".join(cmd), f"(log {log})", flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    url, snaps = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        time.sleep(2)
        snaps.append(snapshot(proc.pid, "ready", log))
        complete(url, SHORT, 2)
        complete(url, LONG, 2)
        snaps.append(snapshot(proc.pid, "2 eager requests", log))
        for c in levels:
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda i: complete(url, f"{SHORT} (variant {i})", 32), range(c)))
            snaps.append(snapshot(proc.pid, f"+{c} x 32 tokens", log))
        text = log.read_text(errors="replace")
        kv = re.search(r"KV cache: (\d+) blocks of (\d+) tokens \(([\d.]+) MiB", text)
        env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TSENGINE_NUM_THREADS")}
        server = {"kv_blocks": int(kv[1]), "kv_block_size": int(kv[2]), "kv_mib_logged": float(kv[3]),
                  "cmd": cmd, "threads_env": env}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return snaps, server


# ---- the report --------------------------------------------------------------------------------------
def attribute(snap: dict, acc: dict, server: dict) -> list[tuple[str, int]]:
    """The anonymous RSS split into what the engine knows, and the rest."""
    rows = [(f"KV cache ({server['kv_blocks']} + 1 scratch blocks x {acc['kv_bytes_per_block']} B, zeroed)",
             (server["kv_blocks"] + 1) * acc["kv_bytes_per_block"])]
    for who in ("target", "head"):
        if f"{who}_params" not in acc:
            continue
        rows += [(f"{who} weights: fp32 parameters (the module's copy)", acc[f"{who}_params"]),
                 (f"{who} weights: oneDNN packed copies ({acc[f'{who}_packed_count']} Linear)", acc[f"{who}_packed"]),
                 (f"{who} weights: few-row panels ({acc[f'{who}_linears']} Linear)", acc[f"{who}_panels"])]
        if acc.get(f"{who}_stacked"):
            rows.append((f"{who} weights: fused stacked fp32 copies", acc[f"{who}_stacked"]))
        if acc.get(f"{who}_stored"):
            rows.append((f"{who} weights: bf16/int8 stored copies", acc[f"{who}_stored"]))
    rows.append(("RoPE tables (cos, sin)", acc["rope"]))
    rows.append(("interpreter, imports, tokenizer (child, before the engine)", acc["anon_imports"]))
    known = sum(v for _, v in rows)
    rest = snap["status"]["RssAnon"] - known
    rows.append(("rest: allocator slack, Python objects, buffers, graph state", rest))
    return rows


def report(snaps: list[dict], acc: dict, server: dict) -> str:
    w = 62
    cols = [s["phase"] for s in snaps]
    line = lambda name, vals: f"{name[:w]:<{w}}" + "".join(f"{v / MiB:>18.1f}" for v in vals)  # noqa: E731
    head = f"{'MiB':<{w}}" + "".join(f"{c[:17]:>18}" for c in cols)
    out = ["RSS by mapping (/proc/PID/smaps)", head]
    out.append(line("VmRSS", [s["status"]["VmRSS"] for s in snaps]))
    out.append(line("VmHWM (peak so far)", [s["status"]["VmHWM"] for s in snaps]))
    out.append(line("file-backed (shared, clean: page cache)", [s["status"]["RssFile"] for s in snaps]))
    for name in snaps[0]["files"]:
        out.append(line("  " + name, [s["files"][name] for s in snaps]))
    out.append(line("anonymous (RssAnon)", [s["status"]["RssAnon"] for s in snaps]))
    for name in snaps[0]["anon"]:
        out.append(line("  " + name, [s["anon"][name] for s in snaps]))
    out.append(f"{'threads':<{w}}" + "".join(f"{s['status']['Threads']:>18}" for s in snaps))
    out.append(f"{'step graphs compiled or loaded (log)':<{w}}" + "".join(f"{len(s['graphs']):>18}" for s in snaps))
    out += ["", "Anonymous RSS attributed (engine's own sizes; packed copies measured by the RSS they free)", head]
    table = [attribute(s, acc, server) for s in snaps]
    for i, (name, _) in enumerate(table[0]):
        out.append(line(name, [t[i][1] for t in table]))
    out.append(line("= RssAnon", [s["status"]["RssAnon"] for s in snaps]))
    graphs = snaps[-1]["graphs"]
    if graphs:
        out.append("graphs: " + ", ".join(f"{g} ({t} s)" for g, t in graphs))
    kv = server["kv_blocks"] * acc["kv_bytes_per_block"] / MiB
    out.append(f"checks: KV logged {server['kv_mib_logged']} MiB, {kv:.1f} MiB computed (+1 scratch block); "
               "target panels "
               f"{acc['target_panels'] / MiB:.1f} MiB by size, {acc['target_panels_rss_drop'] / MiB:.1f} MiB by the "
               "RSS their release gave back")
    if "unread_check" in acc:
        u = acc["unread_check"]
        out.append(f"target's fp32 qkv/o/gate_up/down parameters ({acc['target_linear_params'] / MiB:.1f} MiB) set to "
                   f"NaN (eager, prompts of {u['prompt_tokens']} tokens): greedy tokens "
                   f"{'identical: never read' if u['same_tokens'] else 'CHANGED: read'}")
    first, last = snaps[0]["status"], snaps[-1]["status"]
    out.append(f"VmRSS {first['VmRSS'] / 1e9:.2f} GB ({first['VmRSS'] / 2**30:.2f} GiB) ready, "
               f"{last['VmRSS'] / 1e9:.2f} GB after the requests, peak {last['VmHWM'] / 1e9:.2f} GB")
    return "\n".join(out)


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--account", action="store_true", help=argparse.SUPPRESS)  # the accounting child
    p.add_argument("--check-unread", action="store_true",
                   help="also check that the target's fp32 Linear parameters are never read (NaN-filled, eager)")
    p.add_argument("--concurrency", default="1,4", help="request levels that make decode graphs hot (default 1,4)")
    p.add_argument("--json", help="write every number here")
    p.add_argument("--log", help="the server's log (default /tmp/server-memory-PID.log, this script's PID)")
    args = p.parse_args(own)
    if not any(a == "--model" or a.startswith("--model=") for a in serve_args):
        serve_args = ["--model", "smollm2-135m", *serve_args]
    if args.account:
        print(json.dumps(account(serve_args, args.check_unread)))
        return
    child = [sys.executable, __file__, "--account"] + (["--check-unread"] if args.check_unread else []) + ["--"]
    print("accounting child:", " ".join(child + serve_args), flush=True)
    done = subprocess.run(child + serve_args, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"accounting child failed:\n{done.stderr[-3000:]}")
    acc = json.loads(done.stdout.strip().splitlines()[-1])
    log = Path(args.log or f"/tmp/server-memory-{os.getpid()}.log")
    snaps, server = serve_and_measure(serve_args, [int(c) for c in args.concurrency.split(",") if c], log)
    print(report(snaps, acc, server))
    if args.json:
        Path(args.json).write_text(json.dumps({"accounting": acc, "server": server, "snapshots": snaps}, indent=1))


if __name__ == "__main__":
    main()
