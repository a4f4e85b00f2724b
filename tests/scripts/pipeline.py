"""A small pipeline-parallel training script for the pipeline recovery tests (torch.distributed.pipelining).

World = stages x replicas; ``stage = rank % stages``, ``replica = rank // stages``. Each stage is two Linear
layers with dropout; the last stage computes an MSE loss. Optional cross-stage grad-norm clipping (an all-reduce
inside the step that a replaying stage cannot recompute alone). Deterministic: the model is seeded per stage, the
data of a step is a function of (seed, step, replica). Every rank saves {"step", "stage", "model", "optimizer"}
to --save-dir/rank{RANK}.pt. Runs under swiftrun and torchrun.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel as DDP

import swiftrun


def stage_module(stage: int, hidden: int, dropout: float, seed: int) -> nn.Module:
    torch.manual_seed(seed * 100 + stage)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, hidden))


class Counted(nn.Sequential):
    """A stage that counts its forwards (a side effect that changes nothing the model computes): parallel replay
    must see it and replay the stage alone (runtime/pp/parallel.py, side_state)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(x)


def batch(seed: int, step: int, replica: int, size: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + replica)
    x = torch.randn(size, hidden, generator=g)
    return x, torch.sin(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--clip", type=float, default=0.0, help="clip the global grad norm (all-reduced over stages)")
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count-forwards", type=int, default=-1, metavar="STAGE",
                   help="this stage's module counts its forwards (a side effect parallel replay must refuse)")
    p.add_argument("--save-dir", required=True)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = world // args.dp
    stage, replica = rank % stages, rank // stages
    pipes = [dist.new_group(list(range(r * stages, (r + 1) * stages))) for r in range(args.dp)]
    dps = [dist.new_group(list(range(s, world, stages))) for s in range(stages)]
    pipe_group, dp_group = pipes[replica], dps[stage]

    module = stage_module(stage, args.hidden, args.dropout, args.seed)
    if stage == args.count_forwards:
        module = Counted(*module)
    wrapped: nn.Module = DDP(module, process_group=dp_group) if args.dp > 1 else module
    mb = args.batch // args.microbatches
    pp_stage = PipelineStage(wrapped, stage, stages, torch.device("cpu"), group=pipe_group if args.dp > 1 else None,
                             input_args=torch.empty(mb, args.hidden, requires_grad=stage > 0),
                             output_args=torch.empty(mb, args.hidden, requires_grad=True))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_cls(pp_stage, n_microbatches=args.microbatches, loss_fn=nn.MSELoss())
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)

    run = swiftrun.Run(model=wrapped, optimizer=optimizer, pipeline=schedule, checkpoint_every=args.ckpt_every)
    for step in run.steps(args.steps):
        with run.guard():
            x, y = batch(args.seed, step, replica, args.batch, args.hidden)
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if stage == 0:
                schedule.step(x)
            elif stage == stages - 1:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            if args.clip:
                sq = torch.stack([p.grad.pow(2).sum() for p in module.parameters()]).sum().reshape(1)
                dist.all_reduce(sq, group=pipe_group if args.dp > 1 else None)
                scale = torch.clamp(args.clip / (sq.sqrt() + 1e-6), max=1.0)
                for p_ in module.parameters():
                    p_.grad.mul_(scale)
            optimizer.step()
            if losses:
                run.report(loss=float(torch.stack(losses).detach().mean()))

    os.makedirs(args.save_dir, exist_ok=True)
    torch.save({"step": args.steps, "stage": stage, "model": module.state_dict(),
                "optimizer": optimizer.state_dict()}, os.path.join(args.save_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
