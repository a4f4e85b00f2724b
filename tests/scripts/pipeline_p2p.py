"""A hand-written point-to-point pipeline (Megatron style) for the pipeline recovery tests.

One stage per rank (``stage = rank``); each stage is two Linear layers with dropout, the last one computes an MSE
loss. The script runs its own micro-batch loop: GPipe (every forward, then every backward) or 1F1B. Activations go
downstream with ``dist.isend`` and are received with ``dist.recv``; gradients go upstream with
``dist.batch_isend_irecv`` of ``P2POp``\\s (``--api sync``: ``dist.send``/``dist.recv`` everywhere, GPipe only:
blocking sends deadlock 1F1B). Optional cross-stage grad-norm clipping (an all-reduce inside the step).
``--dp D`` runs D replicas of the pipeline (rank r is stage r % S of replica r // S, S = world / D), each stage's
gradients averaged over its replicas by an explicit all-reduce of one flat buffer after the micro-batches (Megatron's
way, no DDP); replica k trains on its own slice of the step's data.
Deterministic: the model is seeded per stage, the data of a step is a function of (seed, step). Every rank saves
{"step", "stage", "model", "optimizer"} to --save-dir/rank{RANK}.pt. Runs under swiftrun, torchrun, and as a
single process (one stage).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import swiftrun


def stage_module(stage: int, hidden: int, dropout: float, seed: int) -> nn.Module:
    torch.manual_seed(seed * 100 + stage)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                         nn.Dropout(dropout))


def batch(seed: int, step: int, size: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101)
    x = torch.randn(size, hidden, generator=g)
    return x, torch.sin(x)


class Stage:
    """One stage's micro-batch operations; ``pending`` holds the asynchronous sends until the step's end."""

    def __init__(self, module: nn.Module, stage: int, stages: int, api: str, group: object = None,
                 base: int = 0) -> None:
        self.module, self.stage, self.stages, self.api, self.group = module, stage, stages, api, group
        self.prev, self.next = base + stage - 1, base + stage + 1  # global ranks of the neighbours (replica base)
        self.first, self.last = stage == 0, stage == stages - 1
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[torch.Tensor, object]] = []

    def forward(self, m: int, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor | None:
        if not self.first:
            x = torch.empty_like(x)
            dist.recv(x, src=self.prev, group=self.group)
            x.requires_grad_()
        out = self.module(x)
        self.inputs[m] = x
        if self.last:
            loss = nn.functional.mse_loss(out, y) * scale
            self.outputs[m] = loss
            return loss.detach()
        self.outputs[m] = out
        sent = out.detach()
        if self.api == "sync":
            dist.send(sent, dst=self.next, group=self.group)
        else:
            self.pending.append((sent, dist.isend(sent, dst=self.next, group=self.group)))
        return None

    def backward(self, m: int) -> None:
        out = self.outputs.pop(m)
        if self.last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            if self.api == "sync":
                dist.recv(grad, src=self.next, group=self.group)
            else:
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, self.next, self.group)]):
                    work.wait()
            out.backward(grad)
        x = self.inputs.pop(m)
        if not self.first:
            sent = x.grad.detach()
            if self.api == "sync":
                dist.send(sent, dst=self.prev, group=self.group)
            else:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, self.prev, self.group)])
                self.pending.extend((sent, w) for w in works)

    def finish(self) -> None:
        for _, work in self.pending:
            work.wait()
        self.pending.clear()


def train_step(st: Stage, x: torch.Tensor, y: torch.Tensor, microbatches: int, schedule: str) -> list[torch.Tensor]:
    st.inputs.clear(), st.outputs.clear(), st.pending.clear()  # what an interrupted step left behind
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    losses: list[torch.Tensor] = []

    def fwd(m: int) -> None:
        loss = st.forward(m, xs[m], ys[m], 1.0 / microbatches)
        if loss is not None:
            losses.append(loss)

    if schedule == "gpipe":
        for m in range(microbatches):
            fwd(m)
        for m in range(microbatches):
            st.backward(m)
    else:  # 1F1B: warm-up forwards, then one forward and one backward in turn, then the remaining backwards
        warmup = min(st.stages - st.stage - 1, microbatches)
        for m in range(warmup):
            fwd(m)
        for m in range(warmup, microbatches):
            fwd(m)
            st.backward(m - warmup)
        for m in range(microbatches - warmup, microbatches):
            st.backward(m)
    st.finish()
    return losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--api", choices=["async", "sync"], default="async")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--clip", type=float, default=0.0, help="clip the global grad norm (all-reduced over stages)")
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group", action="store_true", help="run the pipeline on a subgroup of its own (dist.new_group)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (see above)")
    p.add_argument("--save-dir", required=True)
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if world % args.dp:
        raise SystemExit(f"pipeline_p2p: world size {world} is not a multiple of --dp {args.dp}")
    stages = world // args.dp
    stage, replica = rank % stages, rank // stages
    group = dp_group = None
    if distributed and (args.group or args.dp > 1):  # every rank creates every group, in the same order
        for r in range(args.dp):
            g = dist.new_group([r * stages + s for s in range(stages)])
            group = g if r == replica else group
    if distributed and args.dp > 1:
        for s in range(stages):
            g = dist.new_group([r * stages + s for r in range(args.dp)])
            dp_group = g if s == stage else dp_group

    module = stage_module(stage, args.hidden, args.dropout, args.seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    run = swiftrun.Run(model=module, optimizer=optimizer, checkpoint_every=args.ckpt_every,
                       pipeline=swiftrun.Stage(index=stage, num_stages=stages, group=group))
    st = Stage(module, stage, stages, args.api, group, base=replica * stages)
    for step in run.steps(args.steps):
        with run.guard():
            x, y = batch(args.seed, step, args.batch * args.dp, args.hidden)
            x, y = x.chunk(args.dp)[replica], y.chunk(args.dp)[replica]
            optimizer.zero_grad(set_to_none=True)
            losses = train_step(st, x, y, args.microbatches, args.schedule)
            if dp_group is not None:  # average the stage's gradients over its replicas, one flat buffer
                grads = [p_.grad for p_ in module.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=dp_group)
                flat /= args.dp
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
            if args.clip:
                sq = torch.stack([p_.grad.pow(2).sum() for p_ in module.parameters()]).sum().reshape(1)
                if distributed:
                    dist.all_reduce(sq, group=group)
                scale = torch.clamp(args.clip / (sq.sqrt() + 1e-6), max=1.0)
                for p_ in module.parameters():
                    p_.grad.mul_(scale)
            optimizer.step()
            if losses:
                run.report(loss=float(torch.stack(losses).sum()))

    os.makedirs(args.save_dir, exist_ok=True)
    torch.save({"step": args.steps, "stage": stage, "model": module.state_dict(),
                "optimizer": optimizer.state_dict()}, os.path.join(args.save_dir, f"rank{rank}.pt"))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
