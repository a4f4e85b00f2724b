"""What the framework integrations' tests share (test_hf.py, test_lightning.py): torchrun's failure-free
references of an example script, cached per argument set, and the rank-by-rank comparison with them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from tests.helpers import EXAMPLES, torchrun_reference

sys.path.insert(0, str(EXAMPLES / "zoo"))
from _common import differing_keys  # noqa: E402


def reference_runs(tmp_path_factory, script: Path, world: int) -> Callable[..., Path]:
    """``get(extra)``: the save directory of torchrun's run of ``script`` with ``extra`` arguments, made once."""
    cache: dict[tuple[str, ...], Path] = {}

    def get(extra: tuple[str, ...] = ()) -> Path:
        if extra not in cache:
            cache[extra] = torchrun_reference(tmp_path_factory.mktemp(f"{script.stem}-ref"), script, world, extra)
        return cache[extra]

    return get


def differences(save: Path, reference: Path, world: int, ignore: tuple[str, ...] = ()) -> list[str]:
    """Per rank, the saved entries that differ from the reference's (bitwise), but those in ``ignore``."""
    problems = []
    for rank in range(world):
        got = torch.load(save / f"rank{rank}.pt", weights_only=True)
        want = torch.load(reference / f"rank{rank}.pt", weights_only=True)
        diff = [k for k in differing_keys(got, want) if k not in ignore]
        if diff:
            problems.append(f"rank {rank}: {diff[:6]}")
    return problems


def outcomes(records: list[dict]) -> list[str]:
    return [r["outcome"] for r in records if r["event"] == "recovery_end"]
