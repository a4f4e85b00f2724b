"""examples/train_dp.py, but a replacement (SWIFTRUN_INCARNATION > 0) first spends SLOW_PREAMBLE_SECONDS in its
preamble, before swiftrun.Run exists: loading a dataset or pretrained weights on a real cluster."""

import os
import runpy
import sys
import time
from pathlib import Path

import swiftrun  # noqa: F401  (the launcher reads this import: the script registers, spares start with the job)

if int(os.environ.get("SWIFTRUN_INCARNATION", "0") or 0) > 0:
    time.sleep(float(os.environ.get("SLOW_PREAMBLE_SECONDS", "0")))
script = Path(__file__).resolve().parents[2] / "examples" / "train_dp.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
