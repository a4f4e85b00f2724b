"""DDP with the PowerSGD gradient-compression comm hook (rank 1, warm start, error feedback), SGD with momentum.

    torchrun --nproc-per-node 2 examples/zoo/powersgd.py --steps 16 --save-dir out/
    swiftrun --nproc-per-node 2 --max-restarts 1 examples/zoo/powersgd.py --steps 16 --save-dir out/

What swiftrun must get right here: PowerSGD keeps per-rank state (each rank's error feedback, the warm-start
matrices, its iteration counter) that does not travel to a replacement, whose compressed gradients would then not
match the survivors' (every recovery ended in a collective-mismatch abort: 16 recoveries in 3 s). ``Run()`` says
so, and a failure restarts every worker (``--max-restarts``) or stops the job with that reason.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp_model = DistributedDataParallel(model)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3,
                                   min_compression_rate=0.5)
    ddp_model.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer)

    for step in run.steps(args.steps):
        with run.guard():
            g = generator(args.seed, step, rank)
            inputs = torch.randn(args.batch, args.features, generator=g)
            targets = torch.tanh(inputs[:, :5].sum(dim=1, keepdim=True))
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            run.report(loss=loss.item())

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
