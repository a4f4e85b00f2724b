"""A swiftrun-aware script whose every rank raises while importing (before swiftrun.Run): the script's own
error, so the job must fail fast. First appends ``<attempt> <rank>`` to the file argv[1]."""

import os
import sys

import swiftrun  # noqa: F401  (the launcher reads this import: the script registers swiftrun.Run)

with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']}\n")

import swiftrun_test_no_such_module  # noqa: E402,F401
