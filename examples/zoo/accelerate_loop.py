"""A custom Accelerate loop recovered in place: what ``accelerator.prepare()`` returned goes to ``swiftrun.Run`` as
it is, and one ``accelerator.accumulate`` window (2 micro-batches) is one step.

An MLP with dropout, AdamW, a per-update LambdaLR warm-up, clipping through ``accelerator.clip_grad_norm_``. The
loader is not prepared: its sampler is a ``swiftrun.ResumableDistributedSampler`` (already one shard per rank),
and ``run.steps(loader=...)`` hands each step its window's batch, which the step splits into micro-batches.

    torchrun --nproc-per-node 2 examples/zoo/accelerate_loop.py --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/accelerate_loop.py --save-dir out/
    python examples/zoo/accelerate_loop.py --save-dir out/

What a recovery must get right here besides the model, AdamW and the schedule: Accelerate's own count of
micro-batches (``accelerator.step``), which decides at which micro-batch gradients are synchronised and the
optimizer really steps. A window cut by a failure and redone must not count its micro-batches twice.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import swiftrun
from _common import Samples, final_state, save_final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--samples", type=int, default=128, help="dataset size (128: 8 steps per epoch on 2 ranks)")
    parser.add_argument("--batch", type=int, default=4, help="per rank, per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: min(1.0, (update + 1) / 4))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    dataset = Samples(args.samples, args.features, args.seed)
    sampler = swiftrun.ResumableDistributedSampler(dataset, seed=args.seed)
    window = args.batch * args.accumulation
    loader = torch.utils.data.DataLoader(dataset, batch_size=window, sampler=sampler, drop_last=True)

    run = swiftrun.Run(model=model, optimizer=optimizer, scheduler=scheduler)
    for step, (inputs, targets) in run.steps(args.steps, loader=loader):
        with run.guard():
            for x, y in zip(inputs.chunk(args.accumulation), targets.chunk(args.accumulation)):
                with accelerator.accumulate(model):
                    loss = nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            run.report(loss=loss.item())

    rank = accelerator.process_index
    inner_opt = getattr(optimizer, "optimizer", optimizer)
    inner_sched = getattr(scheduler, "scheduler", scheduler)
    extra = {"accelerator_step": accelerator.step}
    save_final(args.save_dir, rank, final_state(args.steps, accelerator.unwrap_model(model), [inner_opt],
                                                [inner_sched], extra=extra))
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
