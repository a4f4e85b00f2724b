"""One rank of the multi-process transfer test (tests/integration/test_transfer_gloo.py).

    python transfer_worker.py RANK WORLD INIT_FILE OUT_JSON SCENARIO

Scenarios:
  deliver   world 3, source rank 1, chunk of 64 bytes: rank 0 is a replacement (provides its model tensors,
            allocates the optimizer state), rank 2 a survivor (provides everything, some non-contiguous); then
            the digests agree; then rank 2 perturbs two values and compare_across_ranks names them. Then a
            subgroup {1, 2} transfer with source 2 (rank 0 stays out), and one with chunks of 100 bytes.
  refuse    rank 2 provides a destination of the wrong shape: every rank raises TransferError, and the group
            still works afterwards.
  src-dies  the source exits after chunk 3: the receivers' broadcast must fail, not hang.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist

from swiftrun.runtime.state import digest as D
from swiftrun.runtime.state import transfer as T

torch.set_num_threads(1)


def make_tree(seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.float32):
        size = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw = raw % 2
        return raw.view(dtype).reshape(shape)

    model = OrderedDict()
    model["emb.weight"] = rnd(50, 8)
    model["lin.weight"] = rnd(8, 12).t()  # non-contiguous on the source
    model["lin.bias"] = rnd(8, dtype=torch.bfloat16)
    model["mask"] = rnd(33, dtype=torch.bool)
    model["count"] = rnd(3, dtype=torch.int64)
    model["z"] = rnd(5, dtype=torch.complex64)
    model["scalar"] = torch.tensor(2.5)
    model._metadata = OrderedDict({"": {"version": 1}})
    state = {}
    for i, name in enumerate(["emb.weight", "lin.weight", "lin.bias"]):
        p = model[name]
        state[i] = {"step": torch.tensor(float(7 + i)), "exp_avg": rnd(*p.shape, dtype=p.dtype),
                    "exp_avg_sq": rnd(*p.shape, dtype=p.dtype)}
    opt = {"state": state, "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0, 1, 2]}]}
    return {"models": [model], "optimizers": [opt], "schedulers": [{"last_epoch": 11, "_last_lr": [0.001]}],
            "scaler": None, "user": {"epoch": 3}, "extra": {"step": 11, "rng": torch.Generator().manual_seed(seed).get_state()}}


def same_bits(a, b):
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    a = torch.empty(a.shape, dtype=a.dtype).copy_(a)
    b = torch.empty(b.shape, dtype=b.dtype).copy_(b)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_equal(a, b, path="") -> list[str]:
    bad = []
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and same_bits(a, b)):
            bad.append(path)
    elif isinstance(a, dict):
        if type(a) is not type(b) or list(a) != list(b):
            return [path + " (keys)"]
        for k in a:
            bad += check_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path + " (len)"]
        for i, (x, y) in enumerate(zip(a, b)):
            bad += check_equal(x, y, f"{path}.{i}")
    elif a != b:
        bad.append(path)
    return bad


def own_state(role: str):
    """What a receiver already holds: zeros of the right shapes (a replacement: the model only)."""
    ref = make_tree()
    model = {k: torch.zeros_like(v, memory_format=torch.contiguous_format) for k, v in ref["models"][0].items()}
    model["lin.weight"] = torch.zeros(8, 12).t()  # a non-contiguous destination too
    own = {("models", 0, k): v for k, v in model.items()}
    if role == "survivor":
        for i, st in ref["optimizers"][0]["state"].items():
            for key, value in st.items():
                own[("optimizers", 0, "state", i, key)] = torch.zeros_like(value)
    return own


def deliver(rank: int, out: dict) -> None:
    src = 1
    role = {0: "replacement", 2: "survivor"}.get(rank, "source")
    own = own_state(role) if rank != src else {}
    ptrs = {k: v.data_ptr() for k, v in own.items()}
    chunks_seen: list[int] = []
    stats = T.TransferStats()
    tree = make_tree() if rank == src else None
    result = T.broadcast_tree(tree, src=src, device=torch.device("cpu"), chunk_bytes=64,
                              destination=lambda path, shape, dtype, device: own.get(path),
                              on_chunk=chunks_seen.append, stats=stats)
    ref = make_tree()
    out["deliver_bad"] = check_equal(ref, result)
    out["chunks"] = stats.chunks
    out["chunk_indices_ok"] = chunks_seen == list(range(stats.chunks))
    in_place = []
    for path, t in own.items():
        node = result
        for key in path:
            node = node[key]
        in_place.append(node is t and node.data_ptr() == ptrs[path])
    out["in_place"] = all(in_place) and len(in_place) == len(own)
    out["provided"] = len(own)
    out["allocated"] = stats.allocated
    out["metadata"] = getattr(result["models"][0], "_metadata", None) == {"": {"version": 1}}

    digests = D.digest_tree(result)
    out["agree"] = [str(m) for m in D.compare_across_ranks(digests)]
    if rank == 2:
        result["optimizers"][0]["param_groups"][0]["lr"] = 0.002
        result["models"][0]["lin.bias"][0] += 1
    found = D.compare_across_ranks(D.digest_tree(result))
    out["mismatches"] = [(m.path, list(m.odd_ranks), list(m.majority_ranks)) for m in found]
    out["mismatch_text"] = D.describe(found)

    # a subgroup of source 2 and target 1; rank 0 stays out (but takes part in new_group, as it must)
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        tree = make_tree(5) if rank == 2 else None
        result = T.broadcast_tree(tree, src=2, group=sub, device="cpu", chunk_bytes=100)
        out["subgroup_bad"] = check_equal(make_tree(5), result)
    dist.barrier()
    # chunks of 100 bytes (not a multiple of 8 or 16) over the whole group, nothing provided
    result = T.broadcast_tree(make_tree(9) if rank == 0 else None, src=0, device="cpu", chunk_bytes=100)
    out["unaligned_bad"] = check_equal(make_tree(9), result)
    # the source's chunk size wins (its default here); the receivers' argument is ignored
    stats = T.TransferStats()
    result = T.broadcast_tree(make_tree(3) if rank == 1 else None, src=1, device="cpu",
                              chunk_bytes=None if rank == 1 else 17, stats=stats)
    out["default_bad"] = check_equal(make_tree(3), result)
    out["default_chunk"] = [stats.chunk_bytes, stats.chunks]


def refuse(rank: int, out: dict) -> None:
    def destination(path, shape, dtype, device):
        if rank == 2 and path == ("models", 0, "emb.weight"):
            return torch.zeros(49, 8)
        return None

    try:
        T.broadcast_tree(make_tree() if rank == 0 else None, src=0, device="cpu", chunk_bytes=256,
                         destination=destination)
        out["raised"] = None
    except T.TransferError as exc:
        out["raised"] = str(exc)
    dist.barrier()
    out["group_usable"] = True


def src_dies(rank: int, out: dict) -> None:
    def on_chunk(index):
        if rank == 0 and index == 3:
            os._exit(17)

    start = time.monotonic()
    try:
        T.broadcast_tree(make_tree() if rank == 0 else None, src=0, device="cpu", chunk_bytes=64, on_chunk=on_chunk)
        out["raised"] = None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError (DistBackendError)
        out["raised"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    out["seconds"] = time.monotonic() - start


def main() -> None:
    rank, world, init_file, out_path, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    timeout = timedelta(seconds=float(os.environ.get("TRANSFER_TEST_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    out: dict = {"rank": rank}
    try:
        {"deliver": deliver, "refuse": refuse, "src-dies": src_dies}[scenario](rank, out)
    except Exception:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(out, f)
    if scenario == "src-dies":
        os._exit(0)  # the broken group cannot be torn down cleanly
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
