"""Print one line to stdout and one to stderr, naming the rank."""

import os
import sys

rank = os.environ["RANK"]
print(f"stdout line of rank {rank}")
print(f"stderr line of rank {rank}", file=sys.stderr)
