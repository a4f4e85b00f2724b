#!/usr/bin/env python
"""What the pipeline runtime adds to a failure-free step, part by part, timed alone in one process.

End-to-end ratios (scripts/bench_pp_overhead.py) on a shared 2-core machine move by tens of percent with the
load; the runtime's fixed per-step work is tens of microseconds per part. This times each part directly, on the
middle stage of ``examples/train_pp.py``'s defaults (hidden 64, 8 blocks cut into 4 stages, Adam), best of 7
rounds, one thread:

  * ``Transaction.begin`` with two snapshot slots (pipelines keep what undoes a completed step), and its
    ``rng_state()``: every step start;
  * ``undo.capture`` with gradient copies (pipelines), as the optimizer's step pre-hook calls it: every step;
  * ``Pipeline._record`` of one 8 x 64 boundary tensor (host copy, log entry, volume count): every send;
  * the stage checkpoint's snapshot (``FlatSnapshots.take`` of the state tree and RNG): every checkpoint.

    python scripts/bench_pp_step_parts.py
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import train_pp  # noqa: E402  (imports torch.distributed.pipelining, hence numpy.random, as a real stage does)

from swiftrun.runtime.state import tree as st  # noqa: E402
from swiftrun.runtime.core import undo  # noqa: E402
from swiftrun.runtime.pp.pipeline import Pipeline  # noqa: E402
from swiftrun.runtime.pp.ckpt import FlatSnapshots  # noqa: E402
from swiftrun.runtime.pp.log import LogStore  # noqa: E402
from swiftrun.runtime.state.registry import Registry  # noqa: E402
from swiftrun.runtime.core.txn import Transaction, rng_state  # noqa: E402
from bench_txn_overhead import per_call_us  # noqa: E402  (best of N rounds of mean per-call time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_args = argparse.Namespace(layers=8, hidden=args.hidden, dropout=0.1, seed=0)
    parts = train_pp.build_blocks(model_args, train_pp.StepClock(0, 0))
    model = train_pp.stage_module(parts, 1, 4)
    opt = train_pp.build_optimizer("adam", list(model.parameters()), None)
    x = torch.randn(8, args.hidden)

    def train_step() -> None:  # a stage's compute alone: 4 micro-batches forward and backward, Adam
        opt.zero_grad(set_to_none=True)
        for _ in range(4):
            model(x).sum().backward()
        opt.step()

    train_step()
    reg = Registry.build(model, [opt], [], None, None)
    txn = Transaction(reg, keep=2)
    steps = iter(range(1, 1 << 30))
    log = object.__new__(Pipeline)  # only what _record touches: no process group needed
    log.log, log._volume_now = LogStore(), {}
    sent = torch.randn(8, args.hidden)
    keys = iter(range(1 << 30))

    def record() -> None:
        key = next(keys)
        log._record((key, "act", 1, 2, 0, 0), sent)
        if key % 80 == 79:  # a checkpoint drops the log now and then, as in training
            log.log.clear()

    try:  # what the step pre-hook runs: invertible(), then the capture (older trees check invertible() again)
        undo.capture(opt, True, known_invertible=True)

        def capture() -> None:
            undo.capture(opt, True, known_invertible=undo.invertible(opt)[0])
    except TypeError:
        def capture() -> None:
            undo.invertible(opt)
            undo.capture(opt, True)

    snapshots = FlatSnapshots()
    timed = functools.partial(per_call_us, rounds=7)  # 7 rounds: parts of tens of microseconds are noisier
    results = {
        "stage compute (4 micro-batches, Adam)": timed(train_step, 50),
        "Transaction.begin (two slots)": timed(lambda: txn.begin(next(steps)), args.calls),
        "  of which rng_state()": timed(rng_state, args.calls),
        "undo.capture (gradient copies)": timed(capture, args.calls),
        "Pipeline._record, one 8 x H send": timed(record, args.calls),
        "stage checkpoint snapshot": timed(lambda: snapshots.take(
            {"step": 1, "tree": st.state_tree(reg), "rng": rng_state(), "layouts": None}), 50),
    }
    print(f"train_pp middle stage, hidden {args.hidden}, Adam, {sum(p.numel() for p in model.parameters())} "
          "parameters, 1 thread, best of 7 rounds")
    for name, us in results.items():
        print(f"{name:40s} {us:9.1f} us")


if __name__ == "__main__":
    main()
