#!/usr/bin/env python
"""HSDP (examples/zoo/hsdp.py, 2 replica groups x 2 shards): failure-free step time under swiftrun vs torchrun,
and one in-place recovery's phases.

Step time: interleaved failure-free runs of each launcher (order alternating per repetition), rank 0's mean of
the steady steps (``hsdp: steps=N step_ms=X``). swiftrun runs with its defaults (one warm spare; an HSDP job keeps
a pre-step copy of the local shards and their AdamW state for an exact undo, runtime/hsdp/recovery.py).

Recovery: rank 1 SIGKILLed by an injected fault mid-forward at step ``--kill-step``; the event log's phases
(detect, abort, spawn, rebuild, consensus, undo, transfer, resume) and the kill-to-resumed total, per run, and
whether the recovered run's every rank is bitwise the failure-free one.

    python scripts/bench_hsdp.py                         # 5 x 200 steps, width 1025, 512 features
    python scripts/bench_hsdp.py --quick                 # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchlib as B  # noqa: E402

SCRIPT = B.REPO / "examples" / "zoo" / "hsdp.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--recoveries", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--width", type=int, default=1025)
    p.add_argument("--features", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 40 steps, 1 recovery")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.quick:
        a.steps, a.reps, a.recoveries, a.kill_step = 40, 2, 1, 10
    return a


def main() -> None:
    args = parse_args()
    print(f"# bench_hsdp: {B.machine_line()}")
    print(f"# 4 ranks (2 replicas x 2 shards), width {args.width}, features {args.features}, batch {args.batch}, "
          f"{args.steps} steps, {args.reps} repetition(s)")

    def script(save: Path) -> list[str]:
        return ["--steps", str(args.steps), "--width", str(args.width), "--features", str(args.features),
                "--batch", str(args.batch), "--save-dir", str(save)]

    B.launchers_then_recoveries(args, 4, SCRIPT, script, "step_ms", f"mid-forward at step {args.kill_step}")


if __name__ == "__main__":
    main()
