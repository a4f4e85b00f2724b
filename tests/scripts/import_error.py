"""Fails at import, in every attempt; first appends ``<attempt> <rank>`` to the file argv[1]."""

import os
import sys

with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']}\n")

import swiftrun_test_no_such_module  # noqa: E402,F401
