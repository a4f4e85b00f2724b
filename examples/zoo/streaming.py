"""A streaming loader: an ``IterableDataset`` that yields each rank's shard of an endless record stream, read with
``next(it)`` inside the guard, as scripts over web-scale or generated data do. DDP, SGD.

    torchrun --nproc-per-node 2 examples/zoo/streaming.py --steps 16 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/streaming.py --steps 16 --save-dir out/

What swiftrun must get right here: the stream's position lives in the iterator and cannot be backed up or
restored, so a recovery cannot be exact (the survivor redoes the step with the next batch, the replacement starts
its shard at record 0). swiftrun must say so, at the start and at each recovery, never report an exact recovery.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

import swiftrun
from _common import final_state, generator, init_distributed, save_final


class RecordStream(IterableDataset):
    def __init__(self, rank: int, features: int, seed: int) -> None:
        self.rank, self.features, self.seed = rank, features, seed

    def __iter__(self):
        index = 0
        while True:
            g = generator(self.seed, index, self.rank)
            x = torch.randn(self.features, generator=g)
            yield x, torch.tanh(x[:4].sum()).unsqueeze(0)
            index += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(RecordStream(rank, args.features, args.seed), batch_size=args.batch)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer)
    it = iter(loader)

    for step in run.steps(args.steps):
        with run.guard():
            inputs, targets = next(it)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            run.report(loss=loss.item())

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
