"""Write ``<dir>/<RANK>.pid``, then loop; on SIGTERM write ``<dir>/<RANK>.term`` and exit 143 (argv[1]: dir)."""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import write_atomic  # noqa: E402

out_dir = sys.argv[1]
rank = os.environ["RANK"]


def on_term(signum, frame):
    write_atomic(os.path.join(out_dir, f"{rank}.term"), str(os.getpid()))
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, on_term)
write_atomic(os.path.join(out_dir, f"{rank}.pid"), str(os.getpid()))
deadline = time.monotonic() + 120  # far longer than any test: the launcher must end it
while time.monotonic() < deadline:
    time.sleep(0.05)
