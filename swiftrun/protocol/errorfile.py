"""Torch's ``@record`` error file (``TORCHELASTIC_ERROR_FILE``): what a dying worker writes, what the launcher reads.

It crosses the process boundary, so it lives here, imported by both sides: the runtime's bootstrap writes it when
the script raises, and the launcher reads it to put the traceback into the failure summary. The JSON layout is
torch's (``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``), so a script decorated with ``@record``
reports the same way under torchrun and under swiftrun.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

__all__ = ["write_error_file", "read_error_file"]


def write_error_file(
    path: str | os.PathLike[str], exc_type: str | type[BaseException], message: str, traceback_text: str
) -> None:
    """Write an error file in the format of torch's ``@record`` (``ErrorHandler.record_exception``).

    The file is written to a temporary name and renamed, so a reader never sees half of it.
    """
    type_name = exc_type if isinstance(exc_type, str) else exc_type.__name__
    data = {
        "message": {
            "message": f"{type_name}: {message}",
            "extraInfo": {"py_callstack": traceback_text, "timestamp": str(int(time.time()))},
        }
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def read_error_file(path: str | os.PathLike[str]) -> str | None:
    """The traceback recorded in an error file (else its message), or None if there is no usable file.

    Accepts both layouts torch reads: ``{"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}`` and
    the newer ``{"message": "...", "timestamp": ...}``.
    """
    try:
        with open(path) as fp:
            data = json.load(fp)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return message or None
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    callstack = extra.get("py_callstack") if isinstance(extra, dict) else None
    if isinstance(callstack, str) and callstack:
        return callstack
    text = message.get("message")
    return text if isinstance(text, str) and text else None
