#!/usr/bin/env python
"""The Hugging Face Trainer under ``swiftrun.hf.recoverable`` (examples/zoo/hf_trainer.py, 2 ranks): failure-free
update time under swiftrun vs torchrun, and one in-place recovery's phases.

Update time: interleaved failure-free runs of each launcher (order alternating per repetition), rank 0's mean
time per optimizer update (an accumulation window of 2 micro-batches) after a warm-up
(``hf_trainer: steps=N step_ms=X``). Under torchrun ``recoverable()`` changes nothing, so this is the cost of the
integration plus swiftrun's step transaction.

Recovery: rank 1 SIGKILLed by an injected fault in the first forward of update ``--kill-step``; the event log's
phases and the kill-to-resumed total, per run, and whether every rank ends bitwise as the failure-free run.

    python scripts/bench_hf.py              # 5 x 200 updates, hidden 1024, 512 features, batch 32
    python scripts/bench_hf.py --quick      # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402

SCRIPT = B.REPO / "examples" / "zoo" / "hf_trainer.py"
WARMUP = 10


def parse_args(description: str | None = __doc__) -> argparse.Namespace:
    """The arguments, shared with scripts/bench_lightning.py (its example script takes the same ones)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--recoveries", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 40 updates, 1 recovery")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps, a.recoveries, a.kill_step = 40, 2, 1, 15
    return a


def bench(args: argparse.Namespace, script: Path, title: str) -> None:
    """Time ``script`` (examples/zoo/hf_trainer.py or lightning_ddp.py) under both launchers, then recover it."""
    print(f"# bench_{script.stem}: {B.machine_line()}")
    print(f"# 2 ranks, {title}, hidden {args.hidden}, features {args.features}, batch {args.batch} x 2 "
          f"micro-batches, {args.steps} updates, {args.reps} repetition(s)")
    # one epoch holds every update: 2 ranks x batch x 2 micro-batches per update
    samples = 2 * args.batch * 2 * args.steps

    def script_args(save: Path) -> list[str]:
        return ["--epochs", "1", "--samples", str(samples), "--batch", str(args.batch), "--hidden", str(args.hidden),
                "--features", str(args.features), "--time-steps", str(WARMUP), "--save-dir", str(save)]

    B.launchers_then_recoveries(args, 2, script, script_args, "update ms",
                                f"in the first forward of update {args.kill_step}")


def main() -> None:
    bench(parse_args(), SCRIPT, "HF Trainer")


if __name__ == "__main__":
    main()
