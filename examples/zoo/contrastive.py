"""A contrastive (InfoNCE, SimCLR-style) loss over the *global* batch: each rank embeds two noisy views of its
samples and gathers every rank's second views with ``torch.distributed.nn.functional.all_gather``
(differentiable: the gradients of the gathered embeddings flow back to the rank that computed them), so every
sample is contrasted with the whole world's. An MLP encoder with a projection head, AdamW, StepLR, DDP.

    torchrun --nproc-per-node 2 examples/zoo/contrastive.py --steps 30 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/contrastive.py --steps 30 --save-dir out/
    python examples/zoo/contrastive.py --steps 30 --save-dir out/

What a recovery must get right here: a replacement (a warm spare above all) must gather over the job's real
default group, as a first-generation process does (``torch.distributed.nn.functional`` binds its
``group=group.WORLD`` default when it is imported); a gather on any other group changes the loss silently.
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


def views_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    samples = torch.randn(args.batch, args.features, generator=g)
    return (samples + 0.1 * torch.randn(samples.shape, generator=g),
            samples + 0.1 * torch.randn(samples.shape, generator=g))


def info_nce(first: torch.Tensor, second: torch.Tensor, rank: int, temperature: float) -> torch.Tensor:
    """Each first view's positive is its own second view among every rank's second views."""
    everyone = torch.cat(dist_fn.all_gather(second))  # the default group: the whole world
    logits = first @ everyone.T / temperature
    labels = rank * first.shape[0] + torch.arange(first.shape[0])
    return nn.functional.cross_entropy(logits, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=48)
    parser.add_argument("--dim", type=int, default=16, help="embedding size")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, _ = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden),
                          nn.GELU(), nn.Linear(args.hidden, args.dim))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler)

    for step in run.steps(args.steps):
        with run.guard():
            first, second = views_for(step, rank, args)
            optimizer.zero_grad(set_to_none=True)
            # both views in one forward: DDP's reducer expects one forward per backward
            embedded = nn.functional.normalize(ddp_model(torch.cat([first, second])), dim=1)
            loss = info_nce(embedded[: args.batch], embedded[args.batch:], rank, args.temperature)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler]))
    # The last loss's autograd graph keeps the gather's backward node, whose context holds the gloo group, and
    # DDP's reducer holds it too: drop both while the group is alive. Left to interpreter exit, the last
    # reference can drop inside ~ProcessGroupGloo, whose thread join waits on a gloo worker that waits for the
    # GIL (a hang at exit under plain torchrun on a loaded machine, as examples/zoo/sync_bn.py saw).
    del run, ddp_model, embedded, loss
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
