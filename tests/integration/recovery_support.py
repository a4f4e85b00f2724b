"""What the recovery tests share: how to launch the reference script, how to compare results."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import EXAMPLES, event_records, swiftrun_cmd

STEPS = 12
SCRIPT = str(EXAMPLES / "train_dp.py")
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "6", "--no-dashboard"]


def launch_args(world: int, optimizer: str, save: Path, events: Path, extra: list[str], steps: int = STEPS,
                 script_extra: tuple[str, ...] = ()) -> list[str]:
    return swiftrun_cmd("--nproc-per-node", str(world), *FAST, "--event-log", str(events), *extra, SCRIPT,
                        "--steps", str(steps), "--optimizer", optimizer, "--hidden", "64", "--layers", "3",
                        "--save-dir", str(save), *script_extra)


def load_results(save: Path, world: int) -> list[dict]:
    return [torch.load(save / f"rank{r}.pt") for r in range(world)]


def flat_state(state: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].items()}
    for pid, entries in state["optimizer"]["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                out[f"opt.{pid}.{name}"] = value
    return out


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        scale = max(y.abs().max().item(), 1e-12)
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def recoveries(events: Path) -> list[dict]:
    return [r for r in event_records(events) if r["event"] == "recovery_end"]


def assert_timeline_ends_when_training_did(events: Path) -> None:
    """The report's last progress point is stamped when rank 0's last step came, not when the launcher wrote it at
    teardown (a plot then showed training slowing to a crawl at its very end)."""
    records = event_records(events)
    progress = [r["t"] for r in records if r["event"] == "progress"]
    exited = [r["t"] for r in records if r["event"] == "worker_state" and r["rank"] == 0 and r["state"] == "exited"]
    assert progress and exited and max(progress) <= exited[-1], (progress[-3:], exited)


def assert_recovered_equal(save: Path, reference: Path, world: int, events: Path) -> None:
    results = [flat_state(s) for s in load_results(save, world)]
    for r, result in enumerate(results[1:], start=1):
        for key in results[0]:
            assert torch.equal(results[0][key], result[key]), f"replica {r} differs from rank 0 in {key}"
    expected = flat_state(load_results(reference, 1)[0])
    ended = recoveries(events)
    assert ended and ended[-1]["outcome"] == "recovered", ended
    assert_timeline_ends_when_training_did(events)
    # an undo restores the copy taken before the update: bitwise, unless the recovery said it inverted instead
    inexact = any(rec.get("mode") == "undo" and rec.get("inexact") for rec in ended)
    diff = max_rel_diff(results[0], expected)
    if inexact:
        assert diff <= 1e-6, f"an inexact undo left a relative difference of {diff}"
    else:
        assert diff == 0.0, f"a recovery not reported inexact must be bitwise exact, got relative difference {diff}"
