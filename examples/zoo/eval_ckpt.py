"""An MLP trained with SGD momentum and MultiStepLR, with the periodic evaluation and checkpoint most training
scripts have: every --every steps each rank evaluates on its shard, the metric is all-reduced
(``dist.all_reduce``), rank 0 saves a checkpoint and every rank waits for it (``dist.barrier``).

    torchrun --nproc-per-node 2 examples/zoo/eval_ckpt.py --steps 40 --save-dir out/
    swiftrun --nproc-per-node 2 examples/zoo/eval_ckpt.py --steps 40 --save-dir out/
    python examples/zoo/eval_ckpt.py --steps 40 --save-dir out/

By default the evaluation and the checkpoint come AFTER the ``with run.guard():`` block, in the loop body (the
layout people write); ``--inside-guard`` puts them inside the guard. The evaluation history is registered with
``state=`` so an evaluation counted twice (or lost) after a recovery shows in the final file.

The learning rate drops at steps/4 and steps/2, right after an evaluation step (with the default --every 5 and
--steps 40: the scheduler.step() of steps 9 and 19), so an update undone at an evaluation step shows whether
the lr of the redone step is right.

``--crash RANK:STEP:WHERE`` (tests, the fault campaign) makes rank RANK SIGKILL itself at step STEP right before
the evaluation all-reduce (WHERE=eval) or the checkpoint barrier (WHERE=barrier), once: a marker file in
--save-dir keeps a replacement from crashing again.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import swiftrun
from _common import final_state, generator, init_distributed, save_final


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = generator(args.seed, step, rank)
    inputs = torch.randn(args.batch, args.features, generator=g)
    targets = (inputs[:, :3].sum(dim=1) > 0).long() + (inputs[:, 3] > 1).long()
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--features", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=48)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=5, help="evaluate and checkpoint every this many steps")
    parser.add_argument("--inside-guard", action="store_true", help="evaluate and checkpoint inside the guard")
    parser.add_argument("--ckpt-dir", default=None, help="default: <save-dir>/ckpt")
    parser.add_argument("--crash", default=None, metavar="RANK:STEP:WHERE", help="see above; WHERE: eval, barrier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    args = parser.parse_args()

    rank, world = init_distributed()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(args.features, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 3))
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[args.steps // 4, args.steps // 2],
                                                     gamma=0.3)
    history = {"evals": 0, "eval_sum": 0.0, "last_eval": 0.0, "checkpoints": 0}
    run = swiftrun.Run(model=ddp_model, optimizer=optimizer, scheduler=scheduler, state=history)
    ckpt_dir = args.ckpt_dir or os.path.join(args.save_dir, "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    eval_inputs, eval_targets = batch_for(10**6, rank, args)  # this rank's fixed evaluation shard

    def maybe_crash(step: int, where: str) -> None:
        if args.crash is None:
            return
        crash_rank, crash_step, crash_where = args.crash.split(":")
        marker = os.path.join(args.save_dir, f"crashed-{crash_rank}-{crash_step}-{crash_where}")
        if (int(crash_rank), int(crash_step), crash_where) == (rank, step, where) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def evaluate_and_checkpoint(step: int) -> None:
        if (step + 1) % args.every:
            return
        model.eval()
        with torch.no_grad():
            correct = (model(eval_inputs).argmax(dim=1) == eval_targets).double().mean()
        model.train()
        maybe_crash(step, "eval")
        dist.all_reduce(correct)  # the metric of the whole evaluation set
        accuracy = correct.item() / world
        history["evals"] += 1
        history["eval_sum"] += accuracy
        history["last_eval"] = accuracy
        if rank == 0:
            state = {"step": step + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "history": dict(history)}
            path = os.path.join(ckpt_dir, "latest.pt")
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
        history["checkpoints"] += 1
        maybe_crash(step, "barrier")
        dist.barrier()  # nobody goes on before the checkpoint is on disk

    for step in run.steps(args.steps):
        with run.guard():
            inputs, targets = batch_for(step, rank, args)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(ddp_model(inputs), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            run.report(loss=loss.item())
            if args.inside_guard:
                evaluate_and_checkpoint(step)
        if not args.inside_guard:
            evaluate_and_checkpoint(step)

    save_final(args.save_dir, rank, final_state(args.steps, ddp_model, [optimizer], [scheduler], extra=history))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
