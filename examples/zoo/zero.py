"""DDP with a ``ZeroRedundancyOptimizer`` (AdamW inside): each rank keeps one shard of the optimizer state and
broadcasts its parameters after each step. A MultiStepLR.

    torchrun --nproc-per-node 2 examples/zoo/zero.py --steps 20 --save-dir out/
    swiftrun --nproc-per-node 2 --max-restarts 1 examples/zoo/zero.py --steps 20 --save-dir out/

What swiftrun must get right here: the optimizer captured the default group when it was built, before
``swiftrun.Run`` rebuilt it, and must keep working (it failed at its first step); and a lost rank's shard exists
nowhere else, so a failure cannot be recovered in place: ``Run()`` says so, and a failure restarts every worker
(``--max-restarts``) or stops the job with that reason.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp_model = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[8, 14], gamma=0.5)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler)

    for step in run.steps(args.steps):
        with run.guard():
            g = generator(args.seed, step, rank)
            inputs = torch.randn(args.batch, args.features, generator=g)
            targets = torch.sin(inputs[:, :3].sum(dim=1, keepdim=True))
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())

    optimizer.consolidate_state_dict(to=0)  # a collective on the optimizer's (rebound) group
    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [], [scheduler]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
