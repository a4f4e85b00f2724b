"""An ordinary torchrun DDP script that knows nothing about swiftrun.

    torchrun --nproc-per-node 2 examples/ddp_plain.py
    swiftrun --nproc-per-node 2 examples/ddp_plain.py      # unchanged: swiftrun is a drop-in launcher

It reads its rank and world size from the environment the launcher sets, trains a tiny model for a few steps
and prints one line per rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    # The env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from the launcher.
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).to(device),
        device_ids=[device.index] if use_cuda else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    torch.manual_seed(1 + rank)  # each rank draws its own shard of synthetic data
    for _ in range(5):
        inputs = torch.randn(8, 16, device=device)
        loss = nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    print(f"ddp_plain: rank={rank} world_size={world_size} loss={loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
