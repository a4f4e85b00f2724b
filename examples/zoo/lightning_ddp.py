"""PyTorch Lightning, made recoverable in place with one line: ``strategy=SwiftDDPStrategy(...)``.

A small regression model with dropout, trained by ``lightning.Trainer`` as its users do: AdamW, a OneCycle schedule
stepped per update (``interval="step"``), gradient accumulation over 2 micro-batches, clipping, a loss logged
with ``sync_dist=True`` (an all-reduce in every micro-batch), a shuffled
map-style DataLoader (Lightning injects its DistributedSampler), the default ModelCheckpoint (a save at each
epoch's end) and a CSV logger, two epochs.

    torchrun --nproc-per-node 2 examples/zoo/lightning_ddp.py --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/lightning_ddp.py --save-dir out/
    python examples/zoo/lightning_ddp.py --save-dir out/

The only swiftrun line is the strategy: ``swiftrun.lightning.SwiftDDPStrategy`` takes ``DDPStrategy``'s arguments
(``strategy="swift_ddp"`` works too once ``swiftrun.lightning`` is imported). Under torchrun or as one process it is
Lightning's own ``DDPStrategy``. ``--plain-ddp`` runs with ``DDPStrategy`` itself, to compare; ``--manual`` writes
the update out in ``training_step`` (manual optimization, one update per batch); ``--validate`` adds a validation
loop every 4 training batches, inside the epoch (so inside the step of the window it follows).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from _common import final_state, save_final


class Samples(torch.utils.data.Dataset):
    def __init__(self, size: int, features: int, targets: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.y = torch.tanh(self.x[:, :targets] * 2.0 + self.x[:, targets:2 * targets])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def module_class() -> type:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self, features: int, hidden: int, targets: int, lr: float, total_steps: int,
                     manual: bool) -> None:
            super().__init__()
            self.lr, self.total_steps = lr, total_steps
            self.automatic_optimization = not manual
            self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.2),
                                     nn.Linear(hidden, targets))
            self.losses: list[float] = []
            self.times: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss, sync_dist=True)  # an all-reduce inside the step, as many scripts do
            if not self.automatic_optimization:  # the same update, written out
                optimizer, schedule = self.optimizers(), self.lr_schedulers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                self.clip_gradients(optimizer, gradient_clip_val=1.0)
                optimizer.step()
                schedule.step()
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if not self.automatic_optimization or not self.trainer.fit_loop._should_accumulate():  # noqa: SLF001
                self.losses.append(float(self.trainer.callback_metrics["train_loss"]))  # every rank's mean
                self.times.append(time.perf_counter())

        # what a Lightning checkpoint would carry for this module travels to a replacement the same way
        def on_save_checkpoint(self, checkpoint):
            checkpoint["losses"] = list(self.losses)

        def on_load_checkpoint(self, checkpoint):
            self.losses = list(checkpoint["losses"])

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.total_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Regression


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=80, help="dataset size (80: 5 updates per epoch on 2 ranks)")
    parser.add_argument("--batch", type=int, default=4, help="per rank, per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-ddp", action="store_true", help="Lightning's DDPStrategy instead of swiftrun's")
    parser.add_argument("--validate", action="store_true",
                        help="validate every 4 training batches (inside the epoch), logging val_loss with sync_dist")
    parser.add_argument("--manual", action="store_true",
                        help="manual optimization (training_step steps the optimizer; no accumulation)")
    parser.add_argument("--time-steps", type=int, default=0, metavar="WARMUP",
                        help="print rank 0's mean update time after WARMUP updates (scripts/bench_lightning.py)")
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import swiftrun.lightning

    L.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = 1 if args.manual else args.accumulation
    updates_per_epoch = -(-(-(-args.samples // world) // args.batch) // accumulation)
    model = module_class()(args.features, args.hidden, 4, args.lr, updates_per_epoch * args.epochs, args.manual)
    strategy_class = DDPStrategy if args.plain_ddp else swiftrun.lightning.SwiftDDPStrategy
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        strategy=strategy_class(process_group_backend="gloo"), max_epochs=args.epochs,
        accumulate_grad_batches=accumulation, gradient_clip_val=None if args.manual else 1.0, log_every_n_steps=1,
        default_root_dir=os.path.join(args.save_dir, "lightning"), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
        val_check_interval=4 if args.validate else None, limit_val_batches=None if args.validate else 0)
    loader = torch.utils.data.DataLoader(Samples(args.samples, args.features, 4, args.seed), batch_size=args.batch,
                                         shuffle=True)
    validation = None
    if args.validate:
        validation = torch.utils.data.DataLoader(Samples(32, args.features, 4, args.seed + 1), batch_size=args.batch)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=validation)

    rank = trainer.global_rank
    if args.time_steps and rank == 0:
        steady = model.times[args.time_steps:]
        if len(steady) > 1:
            mean = (steady[-1] - steady[0]) / (len(steady) - 1) * 1000
            print(f"lightning_ddp: steps={len(steady) - 1} step_ms={mean:.3f}", flush=True)
    extra = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "losses": model.losses}
    save_final(args.save_dir, rank, final_state(trainer.global_step, model.net, trainer.optimizers,
                                                [c.scheduler for c in trainer.lr_scheduler_configs], extra=extra))


if __name__ == "__main__":
    main()
