"""An MLP sharded with FSDP2 (``fully_shard``) over every rank: a 1-D mesh, no replica. AdamW.

    torchrun --nproc-per-node 2 examples/zoo/fsdp_1d.py --steps 12 --save-dir out/
    swiftrun --nproc-per-node 2 --max-restarts 1 examples/zoo/fsdp_1d.py --steps 12 --save-dir out/

What swiftrun must get right here: each rank's shard exists on that rank only, so a failure cannot be recovered in
place. ``Run()`` says so at once (naming FSDP and HSDP), failure-free training is untouched, and a failure restarts
every worker (``--max-restarts``) or stops the job within seconds with that reason, never a recovery that ends in
"no surviving replica" or a stall. ``--fault R:S:backward:...`` cannot fire for a sharded model and is refused.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import swiftrun
from _common import generator, init_distributed, save_final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, 32), nn.ReLU(), nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    run = swiftrun.Run(model=model, optimizer=optimizer)

    for step in run.steps(args.steps):
        with run.guard():
            g = generator(args.seed, step, rank)
            inputs = torch.randn(args.batch, args.features, generator=g)
            targets = torch.sin(inputs[:, :3].sum(dim=1, keepdim=True))
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            run.report(loss=loss.item())

    full = {f"model.param.{name}": p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    full["step"] = torch.tensor(args.steps)
    save_final(args.save_dir, rank, full)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
