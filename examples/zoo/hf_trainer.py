"""The Hugging Face Trainer, made recoverable in place with one line: ``swiftrun.hf.recoverable(trainer)``.

A small regression model with dropout, trained by ``transformers.Trainer`` as its users do: AdamW (``adamw_torch``),
a linear schedule with warm-up stepped per update, gradient accumulation over 2 micro-batches, clipping, a
shuffled map-style dataset through the Trainer's own DataLoader (Accelerate shards it), a log every step, two
epochs. The loss is summed over the window's labels and divided by their count across ranks
(``num_items_in_batch``), so the Trainer gathers that count inside each window, as it does for language models.

    torchrun --nproc-per-node 2 examples/zoo/hf_trainer.py --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/hf_trainer.py --save-dir out/
    python examples/zoo/hf_trainer.py --save-dir out/

What a recovery must get right here: the whole accumulation window is redone with the same batches (the
Trainer prefetches it), the schedule, ``TrainerState`` (global step, epoch, log history, FLOPs) and the loss
accumulated since the last log come back with the model, and a replacement starts mid-epoch without a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

import swiftrun
from _common import final_state, save_final


class Regression(nn.Module):
    def __init__(self, features: int, hidden: int, targets: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, targets))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, num_items_in_batch: object = None,
                **kwargs: object) -> dict[str, torch.Tensor]:
        out = self.net(x)
        if labels is None:
            return {"logits": out}
        sse = nn.functional.mse_loss(out, labels, reduction="sum")
        # the Trainer counts labels[..., 1:] (a causal LM's shift) over the window and every rank
        loss = sse / num_items_in_batch if num_items_in_batch is not None else sse / labels.numel()
        return {"loss": loss, "logits": out}


def step_timer(warmup: int) -> object:
    """A callback timing the updates after ``warmup`` (prints ``hf_trainer: steps=N step_ms=X`` on rank 0 at the
    end, for scripts/bench_hf.py)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            steady = self.times[warmup:]
            if state.is_world_process_zero and len(steady) > 1:
                mean = (steady[-1] - steady[0]) / (len(steady) - 1) * 1000
                print(f"hf_trainer: steps={len(steady) - 1} step_ms={mean:.3f}", flush=True)

    return StepTimer()


class Samples(torch.utils.data.Dataset):
    def __init__(self, size: int, features: int, targets: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.y = torch.tanh(self.x[:, :targets] * 2.0 + self.x[:, targets:2 * targets])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=80, help="dataset size (80: 5 updates per epoch on 2 ranks)")
    parser.add_argument("--batch", type=int, default=4, help="per device, per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=-1, help="updates to run (default: the epochs')")
    parser.add_argument("--time-steps", type=int, default=0, metavar="WARMUP",
                        help="print rank 0's mean update time after WARMUP updates (scripts/bench_hf.py)")
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    from transformers import Trainer, TrainingArguments

    targets = 4
    training = TrainingArguments(
        output_dir=os.path.join(args.save_dir, "trainer"), num_train_epochs=args.epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation,
        learning_rate=args.lr, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=1.0,
        optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, seed=args.seed, use_cpu=True, ddp_backend="gloo")
    torch.manual_seed(args.seed)
    model = Regression(args.features, args.hidden, targets)
    callbacks = [step_timer(args.time_steps)] if args.time_steps else None
    trainer = swiftrun.hf.recoverable(Trainer(model=model, args=training, callbacks=callbacks,
                                              train_dataset=Samples(args.samples, args.features, targets, args.seed)))
    output = trainer.train()

    rank = training.process_index
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    extra = {"global_step": trainer.state.global_step, "epoch": trainer.state.epoch, "losses": losses,
             "total_flos": trainer.state.total_flos, "train_loss": output.training_loss}
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside Accelerate's wrapper
    scheduler = getattr(trainer.lr_scheduler, "scheduler", trainer.lr_scheduler)
    save_final(args.save_dir, rank, final_state(trainer.state.global_step, model, [optimizer], [scheduler],
                                                extra=extra))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
