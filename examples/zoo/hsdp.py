"""An MLP trained with HSDP: FSDP2 (``fully_shard``) over a 2-D mesh, 2 replica groups x 2 shards on 4 ranks.
AdamW with weight decay, a warmup-then-decay LambdaLR, gradient clipping over the whole mesh, dropout whose masks
come from each rank's own seed, and one layer whose rows do not split evenly (FSDP pads its shard).

    torchrun --nproc-per-node 4 examples/zoo/hsdp.py --steps 12 --save-dir out/
    swiftrun --nproc-per-node 4 examples/zoo/hsdp.py --steps 12 --save-dir out/

What swiftrun must get right here: rank (r, s) holds shard s of every parameter and of its AdamW moments, and
rank (r', s) of the other replica group holds a bitwise copy. A lost rank is replaced in place: the survivors keep
their processes, the mesh's groups are rebuilt under the names FSDP knows them by, and the replacement receives
its shards, optimizer state, lr and scheduler from its replica. The saved state is each rank's *local* shards, so
the comparison with the failure-free run is exact rank by rank.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import swiftrun
from _common import generator, init_distributed, save_final


def build(args: argparse.Namespace, replicas: int, device: torch.device
          ) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.width), nn.ReLU(), nn.Dropout(args.dropout),
                          nn.Linear(args.width, 24), nn.ReLU(), nn.Linear(24, 1)).to(device)
    world = dist.get_world_size()
    if world == 1:
        mesh = None  # a single process: FSDP over a world of one
    else:  # always an explicit device type: the default would move a gloo mesh to CUDA (pytorch#132471)
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    warmup = 3
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else 0.9 ** (s - warmup))
    return model, optimizer, scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2, help="replica groups (the mesh's first dimension)")
    parser.add_argument("--width", type=int, default=33, help="rows of the first layer (odd: FSDP pads its shard)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every rank on this node's GPU LOCAL_RANK "
                        "modulo the GPUs there (collectives still over gloo; several ranks may share one GPU; "
                        "not yet run on a GPU: scripts/gpu_check_hsdp.sh)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, world = init_distributed()
    if world > 1 and world % args.replicas:
        parser.error(f"--replicas {args.replicas} does not divide the world size {world}")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model, optimizer, scheduler = build(args, args.replicas, device)
    torch.manual_seed(args.seed + 1000 * (rank + 1))  # dropout masks of this rank's own
    run = swiftrun.Run(model=model, optimizer=optimizer, scheduler=scheduler)

    step_ms: dict[int, float] = {}  # keyed by step: a step redone after a recovery keeps its last timing
    for step in run.steps(args.steps):
        started = time.perf_counter()
        with run.guard():
            g = generator(args.seed, step, rank)
            inputs = torch.randn(args.batch, args.features, generator=g).to(device)
            targets = torch.sin(inputs[:, :3].sum(dim=1, keepdim=True))
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())
        step_ms[step] = (time.perf_counter() - started) * 1000.0

    if rank == 0 and step_ms:  # for scripts/bench_hsdp.py: the mean of the steady steps
        timings = [step_ms[s] for s in sorted(step_ms)][max(3, args.steps // 10):] or list(step_ms.values())
        print(f"hsdp: steps={args.steps} step_ms={sum(timings) / len(timings):.3f}", flush=True)

    local = {f"model.param.{name}": p.to_local().detach().cpu().clone() for name, p in model.named_parameters()}
    for index, state in enumerate(optimizer.state.values()):
        for key, value in state.items():
            value = value.to_local() if hasattr(value, "to_local") else value
            local[f"optim.state.{index}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    local["optim.lr"] = torch.tensor(optimizer.param_groups[0]["lr"], dtype=torch.float64)
    local["rng.torch"] = torch.get_rng_state()
    local["step"] = torch.tensor(args.steps)
    save_final(args.save_dir, rank, local)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
