"""Small helpers shared by the worker scripts (torch-free)."""

import os


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader polling for the file never sees it half-written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
