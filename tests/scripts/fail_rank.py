"""Rank 1 fails (argv[1]: ``raise`` -> ValueError, ``kill`` -> SIGKILL to itself); rank 0 waits to be stopped.

argv[2] is a directory: every rank writes ``<RANK>.pid`` there first, so the test can check on them. Rank 1
fails only once rank 0 is running this script, so that there is a live rank for the launcher to stop.
"""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import write_atomic  # noqa: E402

how, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
write_atomic(os.path.join(out_dir, f"{rank}.pid"), str(os.getpid()))
if rank == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out_dir, "0.pid")) and time.monotonic() < deadline:
        time.sleep(0.01)
    if how == "raise":
        raise ValueError("boom at rank 1")
    os.kill(os.getpid(), signal.SIGKILL)
deadline = time.monotonic() + 120  # far longer than the test: rank 0 must be stopped by the launcher
while time.monotonic() < deadline:
    time.sleep(0.05)
