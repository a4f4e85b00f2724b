#!/usr/bin/env python
"""How far an undone update is from the state before it, and how that error grows over the following steps.

One process runs examples/train_dp.py's model and data (rank 0's batch; under DDP the averaged gradient rounds
the same way) twice: failure-free, and with step U applied, undone (runtime/core/undo.py's arithmetic inverse, or
precopy.PreStepCopy with --copy, what --exact-undo does) and redone. Printed: right after the undo, and after later
steps, compared with the failure-free run,

  * per-tensor: max |a-b| / max |b| of each tensor, worst tensor (what the fault campaign used to judge by);
  * per-kind: max |a-b| over a kind of state (all parameters; each optimizer state: every momentum buffer...)
    over that kind's max |b| (what it judges by now, examples/zoo/_common.kind_rel_diff);
  * the largest difference in ULP and how many elements differ.

    python scripts/bench_undo_rounding.py                              # momentum SGD, undo at step 9
    python scripts/bench_undo_rounding.py --optimizer adam --undo-at 3 15
    python scripts/bench_undo_rounding.py --copy                       # the pre-step copy: 0 everywhere
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import train_dp  # noqa: E402

from swiftrun.runtime.core import undo  # noqa: E402
from swiftrun.runtime.core.precopy import PreStepCopy  # noqa: E402

State = dict[str, torch.Tensor]


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> State:
    out = {f"param.{name}": p.detach().clone() for name, p in model.named_parameters()}
    for index, p in enumerate(model.parameters()):
        for key, value in opt.state.get(p, {}).items():
            if key != "step":
                out[f"{key}.{index}"] = value.detach().clone()
    return out


def kind(key: str) -> str:
    return key.split(".", 1)[0]


def per_tensor(a: State, b: State) -> float:
    return max(((a[k].double() - v.double()).abs().max() / v.double().abs().max().clamp_min(1e-12)).item()
               for k, v in b.items())


def per_kind(a: State, b: State) -> float:
    diff: dict[str, float] = {}
    scale: dict[str, float] = {}
    for key, value in b.items():
        diff[kind(key)] = max(diff.get(kind(key), 0.0), (a[key].double() - value.double()).abs().max().item())
        scale[kind(key)] = max(scale.get(kind(key), 0.0), value.double().abs().max().item())
    return max(diff[k] / max(scale[k], 1e-12) for k in diff)


def ulps(a: State, b: State) -> tuple[int, int, int]:
    worst = differ = total = 0
    for key, value in b.items():
        d = (a[key].view(torch.int32).long() - value.view(torch.int32).long()).abs()
        worst, differ, total = max(worst, int(d.max())), differ + int((d > 0).sum()), total + d.numel()
    return worst, differ, total


def describe(a: State, b: State) -> str:
    worst, differ, total = ulps(a, b)
    return (f"per-tensor {per_tensor(a, b):.2e}  per-kind {per_kind(a, b):.2e}  max {worst} ULP, "
            f"{differ}/{total} elements differ")


def train(args: argparse.Namespace, undo_at: int) -> tuple[list[State], str]:
    data = argparse.Namespace(seed=0, batch=32, hidden=args.hidden)
    model = train_dp.build_model(args.hidden, args.layers, 0)
    opt = train_dp.build_optimizer(args.optimizer, list(model.parameters()), None)
    states, after_undo = [], ""
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        inputs, targets = train_dp.batch_for(step, 0, data)
        nn.functional.mse_loss(model(inputs), targets).backward()
        if step == undo_at:
            before = snapshot(model, opt)
            copy, record = PreStepCopy(), None
            if args.copy:
                copy.take(opt, step)
            else:
                record = undo.capture(opt, copy_grads=True)
            opt.step()
            if record is None:
                copy.restore(opt)
            else:
                undo.undo_step(opt, record)
            after_undo = describe(snapshot(model, opt), before)
        opt.step()
        states.append(snapshot(model, opt))
    return states, after_undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimizer", default="momentum", choices=["sgd", "momentum", "nesterov", "adam", "adamw"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--undo-at", type=int, nargs="+", default=[9])
    parser.add_argument("--copy", action="store_true", help="undo with the pre-step copy (--exact-undo)")
    args = parser.parse_args()
    reference, _ = train(args, -1)
    for undo_at in args.undo_at:
        states, after_undo = train(args, undo_at)
        print(f"undo of step {undo_at}, right after the undo: {after_undo}")
        for step in sorted({undo_at, undo_at + 1, undo_at + 5, undo_at + 10, args.steps - 1}):
            if step < args.steps:
                print(f"    after step {step:2d}: {describe(states[step], reference[step])}")


if __name__ == "__main__":
    main()
