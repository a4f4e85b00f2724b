#!/usr/bin/env python
"""Peak extra memory and time of a state transfer: one flat buffer per dtype vs broadcast_tree's chunks.

Three processes on one gloo group (CPU): rank 0 is the source, rank 1 a fresh replacement (its model exists,
its optimizer has no state yet), rank 2 a receiving survivor (model and optimizer state exist and are
overwritten). The state is a model of ``--layers`` Linear(``--width``, ``--width``) layers (float32) and its Adam
state (exp_avg, exp_avg_sq, step), about 200 MB in all with the defaults; each rank builds it (the survivor
and the replacement with other values) and installs what it receives like the runtime would: model tensors
copied into its own parameters, optimizer state through ``Optimizer.load_state_dict``.

Methods:

  flat      today's ``swiftrun.runtime.state.tree.transfer``, re-implemented here so the benchmark outlives its
            rewrite: a pickled description, then per dtype ``torch.cat`` of every tensor on the source; an
            empty flat buffer, one broadcast, a ``clone`` of every slice on the receivers, then the install.
  chunk:N   ``swiftrun.runtime.state.transfer.broadcast_tree`` with chunks of N MiB; receivers hand their own
            parameters (and, on the survivor, its optimizer state tensors) as destinations.

How memory is measured (honest about what it sees): torch's CPU allocator takes its memory from glibc malloc,
so tracemalloc does not see it, and torch keeps no CPU allocator statistics by default. So each rank, once its
state is built, runs ``gc.collect()``, resets its peak RSS (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0),
reads VmRSS (B), does the transfer and the install, and reads VmHWM (P, the peak RSS since the reset).
``peak extra`` = P - B: what the transfer needed above the state the rank already held. On the replacement part
of that is the optimizer state it must allocate anyway (``kept``, printed); ``transient`` = P - B - kept is the
memory that exists only during the transfer. RSS counts pages actually touched, so a buffer allocated but not
written would not count (every buffer here is written). Each configuration runs in fresh processes.

    python scripts/bench_transfer_memory.py                  # flat, chunk 4/16/64 MiB, ~200 MB state
    python scripts/bench_transfer_memory.py --quick          # ~20 MB smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="flat,chunk:4,chunk:16,chunk:64")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smoke test: 2 layers of 640 (~10 MB)")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--worker", nargs=4, metavar=("RANK", "METHOD", "INIT", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.quick:
        a.layers, a.width = 2, 640
    return a


# --------------------------------------------------------------------------------------------------- worker side


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def build(layers: int, width: int, seed: int, with_opt_state: bool):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if with_opt_state:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        for p in model.parameters():
            p.grad = None
    return model, opt


def flat_transfer(model, opt, rank, src, group, device):
    """Today's state.transfer, reduced to model + optimizer (same buffers, same copies)."""
    import torch
    import torch.distributed as dist

    placeholder = "__tensor__"
    tensors = []

    def split(obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device.type and obj.numel() > 1:
                tensors.append(obj.detach())
                return (placeholder, len(tensors) - 1, tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: split(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(split(v) for v in obj)
        return obj

    def slots(obj, out):
        if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == placeholder:
            out.append((obj[1], obj[2], obj[3]))
        elif isinstance(obj, dict):
            for v in obj.values():
                slots(v, out)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                slots(v, out)

    def join(obj, received):
        if isinstance(obj, tuple) and len(obj) == 4 and obj[0] == placeholder:
            return received[obj[1]]
        if isinstance(obj, dict):
            return {k: join(v, received) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(join(v, received) for v in obj)
        return obj

    description = None
    if rank == src:
        description = {"model": split(model.state_dict()), "optimizers": [split(opt.state_dict())]}
    box = [description]
    dist.broadcast_object_list(box, src=src, group=group)
    description = box[0]
    found = []
    slots(description, found)
    found.sort()
    by_dtype = {}
    for index, _shape, dtype in found:
        by_dtype.setdefault(dtype, []).append(index)
    shapes = {index: shape for index, shape, _ in found}
    received = {}
    for dtype, indices in sorted(by_dtype.items()):
        if rank == src:
            flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        else:
            numel = sum(int(torch.Size(shapes[i]).numel()) for i in indices)
            flat = torch.empty(numel, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(flat, src=src, group=group)
        if rank != src:
            offset = 0
            for i in indices:
                n = int(torch.Size(shapes[i]).numel())
                received[i] = flat[offset:offset + n].view(shapes[i]).clone()
                offset += n
        del flat
    if rank != src:
        ordered = [received[i] for i in range(len(found))]
        with torch.no_grad():
            own = model.state_dict()
            for name, value in join(description["model"], ordered).items():
                own[name].copy_(value)
        opt.load_state_dict(join(description["optimizers"][0], ordered))


def chunk_transfer(model, opt, rank, src, group, device, chunk_bytes, survivor):
    from swiftrun.runtime.state.destinations import destination_from, own_tensors
    from swiftrun.runtime.state.transfer import broadcast_tree

    own = own_tensors([model], [opt] if survivor else []) if rank != src else {}
    tree = {"models": [model.state_dict()], "optimizers": [opt.state_dict()]} if rank == src else None
    result = broadcast_tree(tree, src=src, group=group, device=device, chunk_bytes=chunk_bytes,
                            destination=destination_from(own), rank=rank)
    if rank != src:
        opt.load_state_dict(result["optimizers"][0])  # same dtype and device: keeps the tensors, no copy


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, method, init, out = int(args.worker[0]), args.worker[1], args.worker[2], args.worker[3]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=args.timeout))
    device = torch.device("cpu")
    survivor = rank == 2
    model, opt = build(args.layers, args.width, seed=rank, with_opt_state=rank != 1)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * (3 if rank != 1 else 1)
    kept = 0 if rank != 1 else 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kb("VmRSS")
    start = time.perf_counter()
    if method == "flat":
        flat_transfer(model, opt, rank, 0, None, device)
    else:
        chunk_transfer(model, opt, rank, 0, None, device, int(float(method.split(":")[1]) * MiB), survivor)
    seconds = time.perf_counter() - start
    peak = status_kb("VmHWM")
    gc.collect()
    after = status_kb("VmRSS")
    # check: every receiver now holds the source's state
    ref_model, ref_opt = build(args.layers, args.width, seed=0, with_opt_state=True) if rank != 0 else (model, opt)
    ok = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref_model.state_dict().values()))
    ok = ok and all(torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
                    for p, q in zip(model.parameters(), ref_model.parameters()))
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps({"rank": rank, "method": method, "seconds": seconds, "before_kb": before,
                                     "peak_kb": peak, "after_kb": after, "state_bytes": state_bytes,
                                     "kept_bytes": kept, "ok": ok}))


# --------------------------------------------------------------------------------------------------- driver side


def run_config(args: argparse.Namespace, method: str, tmp: Path) -> list[dict]:
    init = tmp / f"init-{method.replace(':', '-')}-{time.monotonic_ns()}"
    outs = [tmp / f"{init.name}-{r}.json" for r in range(3)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    common = ["--layers", str(args.layers), "--width", str(args.width), "--timeout", str(args.timeout)]
    procs = [subprocess.Popen([sys.executable, __file__, *common, "--worker", str(r), method, str(init), str(outs[r])],
                              env=env) for r in range(3)]
    try:
        for p in procs:
            p.wait(timeout=args.timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"{method}: a rank failed ({[p.returncode for p in procs]})")
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    roles = ["source", "replacement", "survivor"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        for rep in range(args.reps):
            for method in args.methods.split(","):
                for r in run_config(args, method, Path(tmp)):
                    r["role"], r["rep"] = roles[r["rank"]], rep
                    rows.append(r)
    params_mb = rows[0]["state_bytes"] / 3 / MiB
    print(f"state: {args.layers} x Linear({args.width}, {args.width}) float32 + Adam: params {params_mb:.1f} MiB, "
          f"params + Adam state {3 * params_mb:.1f} MiB; 3 ranks, gloo, CPU, {os.cpu_count()} cores")
    print(f"{'method':10} {'role':12} {'peak extra MiB':>15} {'kept MiB':>9} {'transient MiB':>14} "
          f"{'x params':>9} {'seconds':>8}  ok")
    for r in rows:
        extra = (r["peak_kb"] - r["before_kb"]) / 1024
        kept = r["kept_bytes"] / MiB
        print(f"{r['method']:10} {r['role']:12} {extra:15.1f} {kept:9.1f} {extra - kept:14.1f} "
              f"{(extra - kept) / params_mb:9.2f} {r['seconds']:8.2f}  {r['ok']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
