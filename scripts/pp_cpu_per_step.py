#!/usr/bin/env python
"""CPU time per training step of every thread of a worker: run a training script through this wrapper.

    PYTHONPATH=. python -m swiftrun --nproc-per-node 4 --no-dashboard --spares 0 scripts/pp_cpu_per_step.py \\
        examples/train_pp.py --steps 2000 --schedule 1f1b --save-dir /tmp/out
    torchrun --nproc-per-node 4 scripts/pp_cpu_per_step.py examples/train_pp.py ...    # the same under torchrun

Wall-clock step times on a shared machine follow the load; CPU time per step follows the work. The wrapper runs
the script as ``__main__`` with ``swiftrun.Run.steps`` wrapped (under torchrun it is a plain range, wrapped the
same way) and, between steps ``CPU_FROM`` (default 200, after start-up) and ``CPU_TO`` (default: the last),
reads the training thread's CPU (``time.thread_time``), the process's, and every thread's utime + stime from
/proc/self/task (gloo's TCP loop, swiftrun's link and checkpoint-exchange threads). Each rank writes
``$CPU_OUT/cpu.rank<R>`` (default /tmp/pp_cpu) and its pid to ``pid.rank<R>``; rank 1 touches ``steady`` 50
steps after ``CPU_FROM`` (a profiler can attach then: ``py-spy record --format raw --threads -p <pid>``).
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's swiftrun, like the other benches
import swiftrun  # noqa: E402

FROM = int(os.environ.get("CPU_FROM", "200"))
TO = int(os.environ.get("CPU_TO", "0"))
OUT = os.environ.get("CPU_OUT", "/tmp/pp_cpu")
TICK = os.sysconf("SC_CLK_TCK")


def threads_cpu() -> dict[str, tuple[str, float]]:
    """tid -> (name, CPU seconds) for every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            data = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:  # the thread ended meanwhile
            continue
        name = data[data.index("(") + 1:data.rindex(")")]
        fields = data[data.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main() -> None:
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        raise SystemExit("usage: pp_cpu_per_step.py SCRIPT [ARGS...]  (a training script that uses swiftrun.Run.steps)")
    rank = os.environ.get("RANK", "0")
    os.makedirs(OUT, exist_ok=True)
    with open(f"{OUT}/pid.rank{rank}", "w") as f:
        f.write(f"{os.getpid()} {threading.get_native_id()}\n")
    original = swiftrun.Run.steps

    def steps(self, total, start=0, loader=None):
        last = TO or total - 1
        marks = {}
        for step in original(self, total, start, loader):
            if step == FROM + 50 and rank == "1":
                open(f"{OUT}/steady", "w").close()
            if step in (FROM, last) and step not in marks:
                marks[step] = (time.thread_time(), time.process_time(), threads_cpu())
                if step == last and FROM in marks:
                    (t0, p0, th0), (t1, p1, th1), n = marks[FROM], marks[last], last - FROM
                    with open(f"{OUT}/cpu.rank{rank}", "w") as f:
                        f.write(f"rank={rank} steps={n} training_thread_us={(t1 - t0) / n * 1e6:.1f} "
                                f"process_us={(p1 - p0) / n * 1e6:.1f}\n")
                        for tid, (name, cpu) in sorted(th1.items()):
                            spent = cpu - th0.get(tid, (name, 0.0))[1]
                            if spent > 0:
                                f.write(f"  thread {tid} {name}: {spent / n * 1e6:.1f} us/step\n")
            yield step

    swiftrun.Run.steps = steps
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
