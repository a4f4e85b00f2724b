from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run
from tests.integration.recovery_support import STEPS, launch_args


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Failure-free results, computed once per configuration and shared by the tests that need them."""
    cache: dict[tuple, Path] = {}

    def get(world: int, optimizer: str, steps: int = STEPS, script_extra: tuple[str, ...] = ()) -> Path:
        key = (world, optimizer, steps, script_extra)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{world}-{optimizer}")
            # failure-free: no warm spare (it would import torch for nothing)
            proc = run(launch_args(world, optimizer, out / "save", out / "events.jsonl", ["--spares", "0"], steps,
                                   script_extra), marker="reference", timeout=180)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[key] = out / "save"
        return cache[key]

    return get
