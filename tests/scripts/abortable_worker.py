"""One rank of the abortable-wait test (tests/integration/test_abortable.py).

    python abortable_worker.py RANK WORLD INIT_FILE OUT_JSON SCENARIO

Scenarios (world 3, gloo on CPU):
  exact  DDP with its built-in all-reduce against the same DDP rebound by swiftrun (runtime/comm/ddp.py ``rebind``:
         the abortable hook and buffer broadcast), 5 steps from the same weights and batches: every step's
         gradients, and the BatchNorm buffers at the end, must be equal bit for bit (world 3: DDP's scaling by 1/3
         is not a division).
  deaf   rank 2 never joins the all-reduce: ranks 0 and 1 block in DDP's backward inside gloo, with every
         connection up (what the abort's socket shutdown cannot release: session 4's "deaf survivor"). Another
         thread aborts the pending waits once they exist; the backward must raise, the group be found blocked and
         kept, the DDP module and group be dropped without joining the blocked gloo thread, and the process exit 0.
  async  the same with the script's own ``dist.all_reduce(..., async_op=True)`` issued through the abortable path
         (how runtime/comm/collectives.py issues it, and FSDP2 its prefetching all-gather): first one every rank
         joins (its handle a ``dist.Work`` whose wait and result are gloo's sum), then one rank 2 never joins,
         whose ``wait()`` must end with the abort.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from swiftrun.runtime.comm import abortable

from swiftrun.runtime.comm import ddp as ddp_tools

torch.set_num_threads(1)
DEADLINE = 20.0  # seconds; the group's collective timeout is far longer, so only the abort can end the waits


def model(bn: bool = False) -> nn.Module:
    torch.manual_seed(0)
    # BatchNorm: buffers DDP broadcasts from rank 0 before every forward (swiftrun's abortable broadcast)
    return nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32) if bn else nn.Identity(), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))


def grads(ddp: DistributedDataParallel, rank: int, steps: int) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(steps):
        batch = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 10 + rank))
        optimizer.zero_grad()
        ddp(batch).pow(2).mean().backward()
        seen.append(torch.cat([p.grad.flatten().clone() for p in ddp.parameters()]))
        optimizer.step()
    return seen


def exact(rank: int) -> dict:
    builtin_ddp = DistributedDataParallel(model(bn=True), bucket_cap_mb=0.002)
    builtin = grads(builtin_ddp, rank, 5)
    ours = DistributedDataParallel(model(bn=True), bucket_cap_mb=0.002)
    ddp_tools.rebind(ours, None)
    hooked = ours._get_ddp_logging_data().get("comm_hook") == ddp_tools.ABORTABLE_HOOK
    rebound = grads(ours, rank, 5)
    buffers = [torch.equal(a, b) for a, b in zip(builtin_ddp.module.buffers(), ours.module.buffers())]
    return {"hooked": hooked, "equal": [bool(torch.equal(a, b)) for a, b in zip(builtin, rebound)],
            "buffers": bool(buffers) and all(buffers)}


def async_all_reduce(tensor: torch.Tensor) -> abortable.WatchedWork:
    return abortable.call("all_reduce", dist.all_reduce, (tensor,), {"async_op": True})


def deaf(rank: int, store: dist.Store, scenario: str) -> dict:
    ddp = DistributedDataParallel(model())
    ddp_tools.rebind(ddp, None)
    abortable.PENDING.open(0)
    joined = {}
    if scenario == "async":  # one that every rank joins: a real handle, gloo's result
        tensor = torch.full((4,), float(rank + 1))
        work = async_all_reduce(tensor)
        joined = {"is_work": isinstance(work, dist.Work), "waited": work.wait(),
                  "result": work.result()[0].tolist(), "success": work.is_success()}
    if rank == 2:  # alive, connected, never joins: the others' all-reduce cannot finish inside gloo
        store.wait(["done0", "done1"], timedelta(seconds=60))
        return {"rank": 2, **joined}

    def abort_when_waiting() -> None:
        end = time.monotonic() + DEADLINE
        while not abortable.PENDING.waiting() and time.monotonic() < end:
            time.sleep(0.01)
        abortable.PENDING.abort(1)

    aborter = threading.Thread(target=abort_when_waiting, daemon=True)
    aborter.start()
    error = ""
    try:
        if scenario == "async":
            async_all_reduce(torch.ones(4)).wait()
        else:
            ddp(torch.randn(4, 32)).sum().backward()
    except RuntimeError as exc:
        error = str(exc)
    blocked = abortable.PENDING.blocked(0)
    kept = abortable.keep_forever([dist.group.WORLD]) if blocked else 0
    dropped = threading.Event()

    def drop() -> None:
        nonlocal ddp
        del ddp
        dist.destroy_process_group()
        gc.collect()
        dropped.set()

    threading.Thread(target=drop, daemon=True).start()
    result = {"rank": rank, "error": error, "blocked": blocked, "kept": kept, "dropped": dropped.wait(DEADLINE),
              **joined}
    store.set(f"done{rank}", "1")
    return result


def main() -> None:
    rank, world, init, out, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    store = dist.FileStore(init, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    result = exact(rank) if scenario == "exact" else deaf(rank, store, scenario)
    with open(out, "w") as f:
        json.dump(result, f)
    if scenario == "exact":
        dist.destroy_process_group()
        # the result is written; what is under test ends here. torch's own teardown at interpreter exit sometimes
        # aborts ("terminate called without an active exception", pytorch/pytorch#65231; seen once in this test in
        # a clean-clone CI run, and in plain torchrun runs in session 5), which says nothing about the hook
        sys.stdout.flush()
        os._exit(0)
    abortable.exit_if_kept(0)  # what swiftrun's bootstrap does after the script (a kept group may wake at exit)


if __name__ == "__main__":
    main()
