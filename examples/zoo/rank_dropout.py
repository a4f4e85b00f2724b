"""An MLP with dropout whose masks come from a random stream of each rank's own: the script seeds the global
generators with ``seed + rank`` before training, as many scripts do so that replicas do not drop the same units.
The model is initialised from the common seed first, so replicas start equal. Python's ``random`` (a per-rank
input jitter) draws from a per-rank stream too. DDP, AdamW, a StepLR.

    torchrun --nproc-per-node 2 examples/zoo/rank_dropout.py --steps 30 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/rank_dropout.py --steps 30 --save-dir out/
    python examples/zoo/rank_dropout.py --steps 30 --save-dir out/

What a recovery must get right here: the replacement continues with *its own* rank's streams from the step it
redoes (backed up by the launcher), not with those of the rank it copied the model from, which would make both
ranks draw the same masks from then on. ``rng.torch`` in the saved state is compared with the failure-free run.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    inputs = torch.randn(args.batch, args.features, generator=g)
    targets = torch.tanh(inputs[:, :4].sum(dim=1, keepdim=True))
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draw-between-steps", action="store_true",
                        help="also draw from Python's generator between steps, outside the guard")
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(args.hidden, 1))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    torch.manual_seed(args.seed + 1000 + rank)  # from here on: dropout masks of each rank's own
    random.seed(args.seed + 2000 + rank)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler)

    jitter = 0.0
    for step in run.steps(args.steps):
        with run.guard():
            inputs, targets = batch_for(step, rank, args)
            inputs = inputs + random.gauss(0.0, 0.01)  # a per-rank draw from Python's generator
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())
        if args.draw_between_steps:
            jitter = random.random()  # outside the guard, between steps: the next step's streams include it

    extra = {"python_rng": random.random(), "jitter": jitter}
    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler], extra=extra))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
