"""Whether the user's script will create ``swiftrun.Run``, read from its source before it runs.

The supervisor needs to know before any rank registers: a rank of a script that registers is still *starting*
until it did (importing torch, building the model), so a failure caused by the infrastructure in that window
restarts the job without touching ``--max-restarts``, and warm spares start with the job. An unmodified torchrun
script never registers, so for it "starting" ends at HELLO and torchrun's behaviour is kept.

A script that imports swiftrun only through a helper module is not recognised here; the first REGISTERED of a
rank tells the supervisor instead (from then on, for the later attempts of the job).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from swiftrun.config import Entrypoint, EntrypointKind

# "import swiftrun", "from swiftrun import Run", "import swiftrun as sr" at the start of a line; not
# "import swiftrun_helpers" ("_" is a word character, so \b does not match after "swiftrun" there)
_IMPORT = re.compile(r"^[ \t]*(?:import|from)[ \t]+swiftrun\b", re.MULTILINE)
_MAX_BYTES = 4 << 20  # a generated multi-megabyte script is read no further than this


def uses_swiftrun(entrypoint: Entrypoint, cwd: str | os.PathLike[str] | None = None) -> bool:
    """True when the entry point's source imports swiftrun (False when it cannot be read, or for --no-python)."""
    path = _source_of(entrypoint, Path(cwd or os.getcwd()))
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return False
    return bool(_IMPORT.search(text))


def _source_of(entrypoint: Entrypoint, cwd: Path) -> Path | None:
    if entrypoint.kind is EntrypointKind.SCRIPT:
        return Path(entrypoint.target)
    if entrypoint.kind is EntrypointKind.MODULE:
        # python -m pkg.mod runs pkg/mod.py or pkg/mod/__main__.py, found from the working directory first
        base = cwd.joinpath(*entrypoint.target.split("."))
        for candidate in (base.with_suffix(".py"), base / "__main__.py"):
            if candidate.is_file():
                return candidate
    return None
