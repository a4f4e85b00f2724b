"""``--no-python`` targets start here: set the parent-death signal, then become the target with execvp.

The parent-death signal survives exec, so a native worker dies with the launcher like a Python one.
"""

from __future__ import annotations

import os
import sys

from swiftrun.runtime.bootstrap import _die_with_parent
from swiftrun.runtime.worker.env import launcher_pid


def main(argv: list[str]) -> None:
    if not argv:
        sys.stderr.write("usage: python -m swiftrun.runtime.execshim TARGET [ARGS...]\n")
        sys.exit(2)
    _die_with_parent(launcher_pid())
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"swiftrun: cannot run {argv[0]!r}: {exc.strerror}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
