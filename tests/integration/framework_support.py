"""What the framework integrations' tests share (test_hf.py, test_lightning.py): torchrun's failure-free
references of an example script, cached per argument set, and the rank-by-rank comparison with them."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tests.helpers import EXAMPLES, draw_seed, event_records, run_killing_at_step, swiftrun_cmd, torchrun_reference

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


@dataclass(frozen=True)
class RandomKill:
    seed: int
    records: list[dict]
    save: Path


def kill_at_a_random_moment(script: Path, args: tuple[str, ...], world: int, flags: list[str], updates: range,
                            tmp_path: Path, marker: str) -> RandomKill:
    """Run ``script`` under swiftrun and SIGKILL a drawn rank from outside once the event log shows a drawn
    update in ``updates`` (wherever in it the kill lands); assert that the job ended well. SWIFTRUN_TEST_SEED
    replays a draw."""
    seed = draw_seed()
    rng = random.Random(seed)
    victim, at = rng.randrange(world), rng.choice(updates)
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    cmd = swiftrun_cmd("--nproc-per-node", str(world), *flags, "--event-log", str(events), str(script), *args,
                       "--save-dir", str(save))
    code, output = run_killing_at_step(cmd, marker, events, victim, at, f"seed {seed}")
    assert code == 0, f"seed {seed}: exit {code}\n{output[-4000:]}"
    return RandomKill(seed, event_records(events), save)
