"""Reference pipeline-parallel training script: an MLP split into stages with torch.distributed.pipelining.

    torchrun --nproc-per-node 4 examples/train_pp.py --steps 40 --schedule 1f1b --save-dir out/
    torchrun --nproc-per-node 4 examples/train_pp.py --steps 40 --dp 2 --save-dir out/      # 2 stages x 2 replicas
    torchrun --nproc-per-node 4 --max-restarts 1 examples/train_pp.py --steps 40 --save-dir out/ \
        --ckpt-dir ckpt/ --ckpt-every 10                  # the global-restart baseline
    swiftrun --nproc-per-node 4 examples/train_pp.py --steps 40 --save-dir out/
    python examples/train_pp.py --steps 40 --save-dir out/       # one process: the whole model, same math

The model is ``--layers`` blocks (Linear(H, H), ReLU, dropout) and a Linear(H, 1) head, regressing a synthetic
target. With W ranks and ``--dp D`` there are S = W / D pipeline ranks per replica; rank r is pipeline rank
``r % S`` of replica ``r // S``. The blocks are cut into S stages (2S with ``--schedule interleaved``: rank r then
holds stages ``r % S`` and ``r % S + S``), the head goes with the last stage, which computes the loss. Each stage
module is built by hand (``PipelineStage``, static shapes) and owns its optimizer; with D > 1 it is wrapped in
DDP on its stage's data-parallel group (the same stage in every replica), and the pipeline of a replica runs on
its own group (with D = 1 on the default group, which a recovery rebuilds).

What is deterministic, so that two failure-free runs, a run resumed from ``--ckpt-dir`` and a run that recovered
end with bitwise-identical rank files:

- the initial weights: the whole model is built from ``--seed`` on every rank, each stage keeps its blocks (so
  the weights do not depend on the number of stages);
- the data: the batch of (step, replica) is a pure function of (seed, step, replica); a redone step gets it again;
- dropout: the mask of block l on micro-batch m of step t is drawn from a generator seeded with
  (seed, t, replica, l, m), m counted from the start of each attempt of the step (each stage runs the forwards
  of a step in micro-batch order in every schedule); no global RNG state is read;
- the reduction order: gradients accumulate over micro-batches in micro-batch order and are divided by M once.

The single-process run does the same arithmetic (micro-batch forwards and backwards through the whole model, in
order, then one division by M) and so ends bitwise equal to the pipeline with D = 1 on this machine, whatever the
schedule. The lines marked ``# swiftrun`` are all it takes to use swiftrun; under plain torchrun they are inert.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel

import swiftrun  # swiftrun

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4, help="per step (1f1b needs >= stages)")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    parser.add_argument("--layers", type=int, default=8, help="hidden blocks, cut into stages (>= stages)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=32, help="samples per replica per step (a multiple of M)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    parser.add_argument("--lr", type=float, default=None, help="default: 1e-3 for adam/adamw, 1e-2 otherwise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--ckpt-dir", default=None, help="periodic stage checkpoints (the torchrun baseline)")
    parser.add_argument("--ckpt-every", type=int, default=10)
    args = parser.parse_args()
    if args.steps < 0 or args.ckpt_every < 1 or args.microbatches < 1 or args.dp < 1:
        parser.error("--steps must be >= 0, --ckpt-every, --microbatches and --dp >= 1")
    if args.batch % args.microbatches:
        parser.error("--batch must be a multiple of --microbatches")
    if not 0.0 <= args.dropout < 1.0:
        parser.error("--dropout must be in [0, 1)")
    return args


# ------------------------------------------------------------------ model, data, optimizer


class StepClock:
    """The (step, attempt) the dropout masks are drawn for; ``begin`` is called at the start of every attempt."""

    def __init__(self, seed: int, replica: int) -> None:
        self.seed, self.replica = seed, replica
        self.step, self.attempt = 0, 0

    def begin(self, step: int) -> None:
        self.step, self.attempt = step, self.attempt + 1


class MicrobatchDropout(nn.Module):
    """Dropout whose mask is a pure function of (seed, step, replica, block, micro-batch): the same in every
    schedule, in a replay of the stage, and in the single-process run. The micro-batch is the number of forwards
    this module ran since the clock's attempt began."""

    def __init__(self, p: float, block: int, clock: StepClock) -> None:
        super().__init__()
        self.p, self.block, self.clock = p, block, clock
        self._attempt, self._calls = -1, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self._attempt != self.clock.attempt:
            self._attempt, self._calls = self.clock.attempt, 0
        micro, self._calls = self._calls, self._calls + 1
        c = self.clock
        seed = ((((c.seed * 1_000_003 + c.step) * 1_009 + c.replica) * 1_013 + self.block) * 1_019 + micro)
        generator = torch.Generator().manual_seed(seed % (2**63))
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=generator)
        return x * keep / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, block={self.block}"


def build_blocks(args: argparse.Namespace, clock: StepClock) -> "OrderedDict[str, nn.Module]":
    """The whole model as named parts ("0".."L-1", "head"), initialised from --seed alone."""
    torch.manual_seed(args.seed)
    parts: OrderedDict[str, nn.Module] = OrderedDict()
    for i in range(args.layers):
        parts[str(i)] = nn.Sequential(nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                                      MicrobatchDropout(args.dropout, i, clock))
    parts["head"] = nn.Linear(args.hidden, 1)
    return parts


def stage_module(parts: "OrderedDict[str, nn.Module]", stage: int, num_stages: int) -> nn.Sequential:
    """Stage ``stage`` of ``num_stages``: a contiguous run of blocks (the first stages take one more when the
    count does not divide), the head with the last. Parameter names are the whole model's ("3.0.weight")."""
    layers = len(parts) - 1
    base, extra = divmod(layers, num_stages)
    start = stage * base + min(stage, extra)
    stop = start + base + (1 if stage < extra else 0)
    names = [str(i) for i in range(start, stop)] + (["head"] if stage == num_stages - 1 else [])
    return nn.Sequential(OrderedDict((name, parts[name]) for name in names))


def build_optimizer(name: str, params: list[nn.Parameter], lr: float | None) -> torch.optim.Optimizer:
    lr = lr if lr is not None else (1e-3 if name in ("adam", "adamw") else 1e-2)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9 if name == "momentum" else 0.0)


def batch_for(step: int, replica: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    # A pure function of (seed, step, replica): a redone or replayed step sees the same batch.
    generator = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 65_537 + replica)
    inputs = torch.randn(args.batch, args.hidden, generator=generator)
    targets = torch.sin(inputs[:, :8].sum(dim=1, keepdim=True) / 2)
    return inputs, targets


# ------------------------------------------------------------------ checkpoints (--ckpt-dir)


def ckpt_path(ckpt_dir: str, stage: int, replica: int, previous: bool = False) -> str:
    return os.path.join(ckpt_dir, f"stage{stage}-replica{replica}{'.prev' if previous else ''}.pt")


def save_checkpoint(ckpt_dir: str, stage: int, replica: int, state: dict) -> None:
    """Atomic (tmp file + os.replace); the previous checkpoint is kept as ``.prev`` because the ranks do not save
    at the same instant: a kill between two ranks' saves leaves some files one checkpoint ahead."""
    latest = ckpt_path(ckpt_dir, stage, replica)
    torch.save(state, latest + ".tmp")
    if os.path.exists(latest):
        os.replace(latest, ckpt_path(ckpt_dir, stage, replica, previous=True))
    os.replace(latest + ".tmp", latest)


def saved_steps(ckpt_dir: str, stage: int, replica: int) -> dict[int, str]:
    out = {}
    for previous in (True, False):
        path = ckpt_path(ckpt_dir, stage, replica, previous)
        if os.path.exists(path):
            out[int(torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"])] = path
    return out


def resume_step(ckpt_dir: str, pipeline_ranks: int, replicas: int) -> int:
    """The newest step every rank has a checkpoint of (step 0 needs none). Read from the files alone, with no
    collective, so every rank decides the same without talking to the others."""
    common: set[int] | None = None
    for stage in range(pipeline_ranks):
        for replica in range(replicas):
            steps = {0, *saved_steps(ckpt_dir, stage, replica)}
            common = steps if common is None else common & steps
    return max(common or {0})


# ------------------------------------------------------------------ main


def init_distributed() -> bool:
    """True when launched (torchrun, swiftrun); a plain ``python`` run trains the whole model in one process."""
    if "RANK" not in os.environ:
        return False
    dist.init_process_group("gloo")
    return True


def run_single(args: argparse.Namespace) -> None:
    """The whole model in one process: the pipeline's arithmetic, micro-batch by micro-batch (replica 0)."""
    if args.dp != 1:
        raise SystemExit("train_pp: a single process runs one replica; drop --dp")
    clock = StepClock(args.seed, replica=0)
    model = nn.Sequential(build_blocks(args, clock))
    optimizer = build_optimizer(args.optimizer, list(model.parameters()), args.lr)
    run = swiftrun.Run(model=model, optimizer=optimizer)  # swiftrun: inert in one process
    step_ms: dict[int, float] = {}
    for step in run.steps(args.steps):
        started = time.perf_counter()
        with run.guard():
            clock.begin(step)
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = batch_for(step, 0, args)
            losses = []
            for x, y in zip(inputs.tensor_split(args.microbatches), targets.tensor_split(args.microbatches)):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                losses.append(loss.detach())
            for p in model.parameters():  # what the schedule's scale_grads does: mean over micro-batches
                if p.grad is not None:
                    p.grad.div_(args.microbatches)
            optimizer.step()
            run.report(loss=torch.stack(losses).mean().item())
        step_ms[step] = (time.perf_counter() - started) * 1000.0
    os.makedirs(args.save_dir, exist_ok=True)
    final = {"step": args.steps, "stage": "all", "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(final, os.path.join(args.save_dir, "rank0.pt"))
    print_timing(args.steps, step_ms)


def print_timing(steps: int, step_ms: dict[int, float], ckpt_every: int = 0) -> None:
    """Rank 0's timing line: the mean step time without the first step; with a checkpoint interval, also the
    mean time of the steps a stage checkpoint starts (ckpt_ms) and of the others (plain_ms): their difference is
    what a checkpoint stalls training."""
    timings = [step_ms[step] for step in sorted(step_ms)]
    steady = timings[1:] or timings or [0.0]  # the first step pays for allocation and the pipeline's warm-up
    line = f"train_pp: steps={steps} step_ms={sum(steady) / len(steady):.3f}"
    later = {s: ms for s, ms in step_ms.items() if s > 0}
    ckpt = [ms for s, ms in later.items() if ckpt_every > 0 and s % ckpt_every == 0]
    plain = [ms for s, ms in later.items() if not (ckpt_every > 0 and s % ckpt_every == 0)]
    if ckpt and plain:
        line += f" ckpt_ms={sum(ckpt) / len(ckpt):.3f} plain_ms={sum(plain) / len(plain):.3f}"
    print(line, flush=True)


def main() -> None:
    args = parse_args()
    if not init_distributed():
        run_single(args)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.dp:
        raise SystemExit(f"train_pp: world size {world} is not a multiple of --dp {args.dp}")
    pp_ranks = world // args.dp  # S
    position, replica = rank % pp_ranks, rank // pp_ranks
    interleaved = args.schedule == "interleaved"
    num_stages = pp_ranks * (2 if interleaved else 1)
    stage_ids = [position, position + pp_ranks] if interleaved else [position]
    if args.layers < num_stages:
        raise SystemExit(f"train_pp: --layers {args.layers} < {num_stages} stages")
    if args.schedule == "1f1b" and args.microbatches < num_stages:
        raise SystemExit(f"train_pp: 1f1b needs --microbatches >= {num_stages} stages")

    # Groups: every rank creates every group, in the same order. With one replica the pipeline is the whole
    # world and uses the default group.
    pp_group = dp_group = None
    if args.dp > 1:
        for r in range(args.dp):
            group = dist.new_group([r * pp_ranks + s for s in range(pp_ranks)])
            pp_group = group if r == replica else pp_group
        for s in range(pp_ranks):
            group = dist.new_group([r * pp_ranks + s for r in range(args.dp)])
            dp_group = group if s == position else dp_group

    clock = StepClock(args.seed, replica)
    parts = build_blocks(args, clock)
    modules = [stage_module(parts, s, num_stages) for s in stage_ids]
    optimizers = [build_optimizer(args.optimizer, list(m.parameters()), args.lr) for m in modules]

    start_step = 0
    if args.ckpt_dir:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        start_step = min(resume_step(args.ckpt_dir, pp_ranks, args.dp), args.steps)
        if start_step > 0:
            checkpoint = torch.load(saved_steps(args.ckpt_dir, position, replica)[start_step], map_location="cpu",
                                    weights_only=True)
            for module, optimizer, model_state, opt_state in zip(modules, optimizers, checkpoint["model"],
                                                                   checkpoint["optimizer"]):
                module.load_state_dict(model_state)
                optimizer.load_state_dict(opt_state)
            if rank == 0:
                print(f"train_pp: resumed from step {start_step}", flush=True)

    micro = args.batch // args.microbatches
    wrapped, stages = [], []
    for module, s in zip(modules, stage_ids):
        # DDP on the stage's data-parallel group; the stage runs its no_sync across micro-batches itself.
        submodule = DistributedDataParallel(module, process_group=dp_group) if args.dp > 1 else module
        wrapped.append(submodule)
        last = s == num_stages - 1
        stages.append(PipelineStage(
            submodule, s, num_stages, torch.device("cpu"),
            input_args=torch.empty(micro, args.hidden, requires_grad=s > 0),  # PIPELINE.md fact 1
            output_args=torch.empty(micro, 1 if last else args.hidden, requires_grad=True),
            group=pp_group))
    loss_fn = nn.MSELoss()
    if interleaved:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    else:
        schedule = SCHEDULES[args.schedule](stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    has_first, has_last = 0 in stage_ids, num_stages - 1 in stage_ids

    run = swiftrun.Run(model=wrapped if interleaved else wrapped[0],  # swiftrun: what a recovery must restore
                       optimizer=optimizers if interleaved else optimizers[0], pipeline=schedule,
                       checkpoint_every=args.ckpt_every)  # swiftrun: the stage checkpoint interval
    step_ms: dict[int, float] = {}
    started = time.perf_counter()  # a step's time includes the runtime's work at its start (checkpoints)
    for step in run.steps(args.steps, start=start_step):  # swiftrun: yields the step to (re)do
        with run.guard():  # swiftrun: a failure in here is recovered and the step retried
            clock.begin(step)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)  # at the start: a redone step never sees partial grads
            inputs, targets = batch_for(step, replica, args)
            losses: list[torch.Tensor] = []
            schedule.step(*([inputs] if has_first else []), target=targets if has_last else None,
                          losses=losses if has_last else None)
            for optimizer in optimizers:
                optimizer.step()
            run.report(loss=torch.stack(losses).mean().item() if losses else None)  # swiftrun: optional
            if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:  # inside the guard: never after a failed try
                save_checkpoint(args.ckpt_dir, position, replica, {
                    "step": step + 1, "stage": stage_ids,
                    "model": [m.state_dict() for m in modules], "optimizer": [o.state_dict() for o in optimizers]})
        now = time.perf_counter()
        step_ms[step], started = (now - started) * 1000.0, now

    os.makedirs(args.save_dir, exist_ok=True)
    model_state: dict[str, torch.Tensor] = {}
    for module in modules:  # the unwrapped stage modules; names are the whole model's, so they merge
        model_state.update(module.state_dict())
    final = {"step": args.steps, "stage": stage_ids if interleaved else stage_ids[0], "model": model_state,
             "optimizer": [o.state_dict() for o in optimizers] if interleaved else optimizers[0].state_dict()}
    torch.save(final, os.path.join(args.save_dir, f"rank{rank}.pt"))
    if rank == 0:
        print_timing(args.steps, step_ms, args.ckpt_every)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
