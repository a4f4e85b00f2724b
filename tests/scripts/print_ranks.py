"""Print one line to stdout and one to stderr, naming the rank."""

import os
import sys

rank = os.environ["RANK"]
# One write per line: the tests run workers with PYTHONUNBUFFERED=1, where print() issues the text and its newline
# as two writes, and the two ranks sharing one stdout pipe could interleave them ("...rank 1stdout line of rank 0",
# seen once in CI). A single write under PIPE_BUF reaches the pipe whole.
sys.stdout.write(f"stdout line of rank {rank}\n")
sys.stderr.write(f"stderr line of rank {rank}\n")
