"""An MLP whose batch normalisation uses the statistics of the *global* batch, as SyncBatchNorm does: the
per-feature sums are all-reduced in the forward with ``torch.distributed.nn.functional.all_reduce`` (which is
differentiable, so the backward all-reduces their gradients too). torch's own SyncBatchNorm runs on GPUs only;
this is the same computation on the CPU. DDP with ``forward_sync_buffers=False`` (``broadcast_buffers=False``
before torch 2.13), as usual with synchronised statistics: every rank computes the same running statistics
itself. SGD with momentum, CosineAnnealingLR.

    torchrun --nproc-per-node 2 examples/zoo/sync_bn.py --steps 30 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/sync_bn.py --steps 30 --save-dir out/
    python examples/zoo/sync_bn.py --steps 30 --save-dir out/

What a recovery must get right here: a replacement (a warm spare above all) must run
``torch.distributed.nn.functional``'s collectives on the job's real default group, as a first-generation
process does (their ``group=group.WORLD`` default is bound when the module is imported); and the running
statistics, equal on every rank by the script's own synchronisation, must stay equal (and be verified so).
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


class GlobalBatchNorm(nn.Module):
    """BatchNorm1d over the batch of every rank: mean and variance from all-reduced sums."""

    def __init__(self, features: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))
        self.register_buffer("running_mean", torch.zeros(features))
        self.register_buffer("running_var", torch.ones(features))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            mean, var = self.running_mean, self.running_var
        else:
            count = torch.full((1,), float(x.shape[0]))
            stats = dist_fn.all_reduce(torch.cat([x.sum(0), (x * x).sum(0), count]))  # the default group
            n = stats[-1]
            mean = stats[: x.shape[1]] / n
            var = stats[x.shape[1]: 2 * x.shape[1]] / n - mean * mean
            with torch.no_grad():
                unbiased = var * n / (n - 1)
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(unbiased, self.momentum)
                self.num_batches_tracked += 1
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    # each rank's batch has its own offset: the local statistics differ from the global ones
    inputs = torch.randn(args.batch, args.features, generator=g) * (1.0 + rank) + rank
    targets = torch.sin(inputs[:, :3].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(args.batch, 1, generator=g)
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), GlobalBatchNorm(args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), GlobalBatchNorm(args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 1))
    ddp_model = DistributedDataParallel(model, forward_sync_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler)

    for step in run.steps(args.steps):
        with run.guard():
            inputs, targets = batch_for(step, rank, args)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler]))
    # Free DDP's reducer while the group is still alive: left to interpreter exit, the reducer's last reference
    # to the gloo group can drop inside ~ProcessGroupGloo, whose thread join then waits on a gloo worker that
    # waits for the GIL (seen as a hang at exit under plain torchrun on a loaded machine).
    del run, ddp_model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
