"""A plain (torch-free, swiftrun-unaware) loop of small sleeps.

argv[1]: a directory; argv[2]: seconds to run in restart attempt 0 (later attempts run 0.5 s).
In attempt 0 rank 1 writes its pid to ``<dir>/hang.pid`` so that the test can SIGSTOP it; every attempt of
every rank appends ``<attempt> <rank>`` to ``<dir>/attempts``.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import write_atomic  # noqa: E402

out_dir = sys.argv[1]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["RANK"]
with open(os.path.join(out_dir, "attempts"), "a") as f:
    f.write(f"{attempt} {rank}\n")
seconds = float(sys.argv[2]) if attempt == "0" else 0.5
if attempt == "0" and rank == "1":
    write_atomic(os.path.join(out_dir, "hang.pid"), str(os.getpid()))
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    time.sleep(0.05)
