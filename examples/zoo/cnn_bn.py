"""A small CNN with BatchNorm on synthetic images: SGD (Nesterov, weight decay), OneCycleLR cycling the momentum
too, bf16 autocast on the CPU with a GradScaler, DDP.

    torchrun --nproc-per-node 2 examples/zoo/cnn_bn.py --steps 40 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/cnn_bn.py --steps 40 --save-dir out/
    python examples/zoo/cnn_bn.py --steps 40 --save-dir out/

What a recovery must get right here: BatchNorm running statistics and num_batches_tracked (buffers updated by
the forward pass, not by the optimizer), a non-persistent buffer, the scheduler's writes into param_groups (lr
and momentum), and the scaler's scale and growth tracker.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


class Net(nn.Module):
    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(2 * width, classes)
        # a buffer that is not in state_dict (persistent=False): samples this replica has seen in training
        self.register_buffer("samples_seen", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.samples_seen += x.shape[0]
        return self.head(self.features(x))


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    labels = torch.randint(0, args.classes, (args.batch,), generator=g)
    # class-dependent mean colour plus noise: learnable, and BatchNorm statistics move every step
    means = torch.linspace(-1.0, 1.0, args.classes)[labels].view(-1, 1, 1, 1)
    images = means + 0.7 * torch.randn(args.batch, 3, args.size, args.size, generator=g)
    return images, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="images per rank per step")
    parser.add_argument("--size", type=int, default=12)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--classes", type=int, default=5)
    parser.add_argument("--max-lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = Net(args.width, args.classes)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.max_lr / 25, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.max_lr, total_steps=args.steps,
                                                    cycle_momentum=True, base_momentum=0.85, max_momentum=0.95)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=8)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)

    for step in run.steps(args.steps):
        with run.guard():
            images, labels = batch_for(step, rank, args)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(ddp_model(images), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            run.report(loss=loss.item(), lr=scheduler.get_last_lr()[0])

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler], scaler))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
