"""An MLP with an exponential moving average of its weights (torch.optim.swa_utils.AveragedModel), Adam, and a
chainable scheduler (ExponentialLR, or StepLR with --scheduler step).

    torchrun --nproc-per-node 2 examples/zoo/ema.py --steps 40 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/ema.py --steps 40 --save-dir out/
    python examples/zoo/ema.py --steps 40 --save-dir out/

The EMA is updated right after each optimizer step, inside the guard, and registered with ``state=ema_model``.
What a recovery must get right here: the EMA weights and its n_averaged counter (an update applied once more, or
not at all, after a recovery shows), and the lr a chainable scheduler derives from ``param_groups`` itself.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import swiftrun
from _common import final_state, generator, init_distributed, save_final


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    inputs = torch.randn(args.batch, args.features, generator=g)
    targets = torch.tanh(inputs[:, :4].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(args.batch, 1, generator=g)
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--decay", type=float, default=0.9, help="EMA decay")
    parser.add_argument("--scheduler", choices=("exponential", "step"), default="exponential")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.LayerNorm(args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    ddp_model = DistributedDataParallel(model)
    ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.decay), use_buffers=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.scheduler == "exponential":
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler, state=ema_model)

    for step in run.steps(args.steps):
        with run.guard():
            inputs, targets = batch_for(step, rank, args)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            ema_model.update_parameters(model)
            scheduler.step()
            run.report(loss=loss.item())

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler],
                                                modules={"ema": ema_model}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
