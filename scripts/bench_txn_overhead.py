#!/usr/bin/env python
"""What the runtime adds to every failure-free step, measured in one process with nothing else in the way.

End-to-end comparisons (scripts/bench_step_time.py) on a shared 2-core machine move by tens of percent from run
to run; the per-step work of the transaction runtime is a few hundred microseconds and drowns in that. This
times its parts directly, on examples/train_dp.py's model (one thread):

  * the training step itself (forward, backward, optimizer step; no all-reduce: one process);
  * Transaction.begin (runtime/core/txn.py): every buffer, the param groups' hyperparameters, schedulers, scaler,
    user state, RNG streams, the parameters' version counters; and its parts rng_state() and param_versions();
  * undo.capture(copy_grads=False): the references the optimizer's step pre-hook keeps (auto mode);
  * PreStepCopy.take: the copy made before each optimizer step wherever the job may undo (by default: DDP
    broadcasting buffers, a pipeline, a collective after optimizer.step(); always with --exact-undo);
  * the per-rank RNG backup: streams.encode(rng_state()), made twice per step (step start, first update) and
    handed to the link thread (runtime/core/streams.py).

    python scripts/bench_txn_overhead.py                     # hidden 256, 4 layers, Adam (train_dp's defaults)
    python scripts/bench_txn_overhead.py --hidden 1024 --optimizer momentum
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
import train_dp  # noqa: E402

from swiftrun.runtime.core import streams, undo  # noqa: E402
from swiftrun.runtime.state.registry import Registry  # noqa: E402
from swiftrun.runtime.core.precopy import PreStepCopy  # noqa: E402
from swiftrun.runtime.core.txn import Transaction, param_versions, rng_state  # noqa: E402


def per_call_us(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    """Mean time of one call, the best of ``rounds`` rounds: on a shared machine the minimum is the estimate
    least disturbed by other processes."""
    fn()  # allocations of the first call (copy buffers) are not per-step costs
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "momentum", "nesterov", "adam", "adamw"])
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = train_dp.build_model(args.hidden, args.layers, 0)
    opt = train_dp.build_optimizer(args.optimizer, list(model.parameters()), None)
    reg = Registry.build(model, [opt], [], None, None)
    txn = Transaction(reg)
    pre = PreStepCopy()
    inputs, targets = train_dp.batch_for(0, 0, argparse.Namespace(seed=0, batch=32, hidden=args.hidden))

    def train_step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(inputs), targets).backward()
        opt.step()

    train_step()  # the optimizer's state exists from here on, as in every step but the first
    step_us = per_call_us(train_step, args.calls)
    parts = {
        "Transaction.begin": per_call_us(lambda: txn.begin(5), args.calls),
        "  of which rng_state()": per_call_us(rng_state, args.calls),
        "  of which param_versions()": per_call_us(lambda: param_versions(reg), args.calls),
        "undo.capture (references)": per_call_us(lambda: undo.capture(opt, False), args.calls),
        "PreStepCopy.take (exact undo)": per_call_us(lambda: pre.take(opt, 5), args.calls),
        "RNG backup encode (x2 per step)": 2 * per_call_us(lambda: streams.encode(rng_state()), args.calls),
    }
    count = sum(p.numel() for p in model.parameters())
    print(f"train_dp hidden {args.hidden} x {args.layers} layers, {args.optimizer}, {count / 1e6:.2f}M parameters, "
          f"1 thread")
    print(f"{'training step (fwd, bwd, optimizer)':36s} {step_us:9.1f} us")
    for name, us in parts.items():
        print(f"{name:36s} {us:9.1f} us  ({us / step_us * 100:5.1f}% of the step)")


if __name__ == "__main__":
    main()
