"""Reference data-parallel training script: a small MLP regressing synthetic data.

    swiftrun --nproc-per-node 4 examples/train_dp.py --steps 200 --optimizer adam --save-dir out/
    torchrun --nproc-per-node 4 examples/train_dp.py --steps 200 --optimizer adam --save-dir out/ \
        --ckpt-dir ckpt/ --ckpt-every 20                  # the checkpoint-restart baseline
    python examples/train_dp.py --steps 20 --optimizer sgd --save-dir out/   # one process, no launcher

Everything is deterministic: the model is initialised from --seed on every rank and the batch of (step, rank) is
a pure function of seed, step and rank, so a run that recovers (or restarts from a checkpoint) ends bitwise equal
to one that never failed. The lines marked ``# swiftrun`` are all it takes to use in-place recovery; under plain
torchrun they are inert.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import swiftrun  # swiftrun

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw", "amsgrad", "adagrad")  # the last two cannot be undone


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, required=True)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 for adam/adamw, 1e-2 otherwise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--ckpt-dir", default=None, help="periodic checkpoints (the torchrun baseline)")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--sync-loss", action="store_true",
                        help="all-reduce the loss after every optimizer step (a collective after the update)")
    args = parser.parse_args()
    if args.steps < 0 or args.ckpt_every < 1:
        parser.error("--steps must be >= 0 and --ckpt-every >= 1")
    return args


def init_distributed() -> torch.device:
    if "RANK" not in os.environ:  # no launcher: a world of one, so the same DDP code path still runs
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build_model(hidden: int, layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)  # identical initial weights on every rank, independent of the launcher
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def build_optimizer(name: str, params: list[nn.Parameter], lr: float | None) -> torch.optim.Optimizer:
    lr = lr if lr is not None else (1e-3 if name in ("adam", "adamw", "amsgrad") else 1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "amsgrad":
        return torch.optim.Adam(params, lr=lr, amsgrad=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr)
    momentum = {"sgd": 0.0, "momentum": 0.9, "nesterov": 0.9}[name]
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov")


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    # Generated on the CPU so the numbers do not depend on the device; a redone step sees the same batch.
    generator = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 65_537 + rank)
    inputs = torch.randn(args.batch, args.hidden, generator=generator)
    targets = torch.sin(inputs[:, :8].sum(dim=1, keepdim=True) / 2)  # smooth enough for the MLP to learn
    return inputs, targets


def main() -> None:
    args = parse_args()
    device = init_distributed()
    rank = dist.get_rank()
    model = build_model(args.hidden, args.layers, args.seed).to(device)
    optimizer = build_optimizer(args.optimizer, list(model.parameters()), args.lr)

    start_step, latest = 0, None
    if args.ckpt_dir:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        latest = os.path.join(args.ckpt_dir, "latest.pt")
    # Every rank reads the same file, so no broadcast is needed; rank 0 cannot replace it before all ranks have
    # loaded it, because the next save follows a step whose gradient all-reduce needs every rank.
    if latest and os.path.exists(latest):
        checkpoint = torch.load(latest, map_location=device)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_step = checkpoint["step"]

    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer)  # swiftrun: what a recovery must restore
    step_ms: dict[int, float] = {}  # keyed by step: a step redone after a recovery keeps its last timing

    for step in run.steps(args.steps, start=start_step):  # swiftrun: yields the step to (re)do
        started = time.perf_counter()
        with run.guard():  # swiftrun: a failure in here is recovered and the step retried
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = (t.to(device) for t in batch_for(step, rank, args))
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            if args.sync_loss:  # a collective *after* the update: a failure here leaves the update half-done
                dist.all_reduce(loss.detach(), op=dist.ReduceOp.SUM)
            run.report(loss=loss.item())  # swiftrun: optional; .item() also syncs the GPU for the timing
            # Inside the guard, so that an attempt that failed (and was recovered) never saves a checkpoint.
            if latest and rank == 0 and (step + 1) % args.ckpt_every == 0:
                state = {"step": step + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save(state, latest + ".tmp")
                os.replace(latest + ".tmp", latest)  # atomic: a kill mid-save leaves the previous checkpoint
        step_ms[step] = (time.perf_counter() - started) * 1000.0

    os.makedirs(args.save_dir, exist_ok=True)
    final = {"step": args.steps, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(final, os.path.join(args.save_dir, f"rank{rank}.pt"))

    if rank == 0:
        timings = [step_ms[step] for step in sorted(step_ms)]
        warmup = max(3, len(timings) // 10)  # the first steps of this process pay for allocation and caching
        steady = timings[warmup:] or timings or [0.0]
        print(f"train_dp: steps={args.steps} step_ms={sum(steady) / len(steady):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
