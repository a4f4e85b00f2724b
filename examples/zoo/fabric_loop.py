"""A custom Lightning Fabric loop recovered in place: what ``fabric.setup()`` returned goes to ``swiftrun.Run`` as
it is (a ``_FabricModule`` around Fabric's DDP, a ``_FabricOptimizer``).

An MLP with dropout, AdamW, a per-update LambdaLR warm-up, clipping through ``fabric.clip_gradients`` and the
backward through ``fabric.backward``. The loader is not set up by Fabric: its sampler is a
``swiftrun.ResumableDistributedSampler`` (one shard per rank, as Fabric's own would be), and
``run.steps(loader=...)`` hands each step its batch.

    torchrun --nproc-per-node 2 examples/zoo/fabric_loop.py --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/fabric_loop.py --save-dir out/
    python examples/zoo/fabric_loop.py --save-dir out/

Fabric finds torchrun's (and swiftrun's) environment itself and joins the job's process group; run as one
process it trains on one device with no group at all.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import swiftrun
from _common import Samples, final_state, save_final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples", type=int, default=128, help="dataset size (128: 8 steps per epoch on 2 ranks)")
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    from lightning.fabric import Fabric

    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                    num_nodes=max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
                    strategy="ddp" if world > 1 else "auto")
    fabric.launch()  # under torchrun or swiftrun: the processes exist already, Fabric only joins the group
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda update: min(1.0, (update + 1) / 4))

    dataset = Samples(args.samples, args.features, args.seed)
    sampler = swiftrun.ResumableDistributedSampler(dataset, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)

    run = swiftrun.Run(model=model, optimizer=optimizer, scheduler=scheduler)
    for step, (inputs, targets) in run.steps(args.steps, loader=loader):
        with run.guard():
            loss = nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            run.report(loss=loss.item())

    save_final(args.save_dir, fabric.global_rank, final_state(args.steps, model.module, [optimizer.optimizer],
                                                             [scheduler]))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
