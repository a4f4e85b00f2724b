"""Waits the abort always ends, over a real gloo group of 3 processes (tests/scripts/abortable_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers import SCRIPTS, start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def run_world(tmp_path, marker, scenario: str, world: int = 3, deadline: float = 100.0) -> list[dict | None]:
    procs, outs = [], [tmp_path / f"out{r}.json" for r in range(world)]
    try:
        for r in range(world):
            procs.append(start([sys.executable, str(SCRIPTS / "abortable_worker.py"), str(r), str(world),
                                str(tmp_path / "init"), str(outs[r]), scenario], marker))
        end = time.monotonic() + deadline
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: ranks still running after {deadline}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            _, err = p.communicate(timeout=10)
            if p.returncode != 0:
                print(err[-3000:])
    assert [p.returncode for p in procs] == [0] * world
    return [json.loads(o.read_text()) if o.exists() else None for o in outs]


def test_the_abortable_ddp_all_reduce_is_bitwise_ddps_own_at_world_3(tmp_path, marker):
    for out in run_world(tmp_path, marker, "exact"):
        assert out is not None and out["hooked"], out
        assert out["equal"] == [True] * 5 and out["buffers"], out


def test_a_ddp_backward_blocked_inside_gloo_ends_with_the_abort_and_its_group_is_kept(tmp_path, marker):
    outs = run_world(tmp_path, marker, "deaf")
    for out in outs[:2]:
        assert out is not None, outs
        assert "aborted by a swiftrun recovery" in out["error"], out
        assert out["blocked"] and out["kept"] == 1, out
        assert out["dropped"], out  # dropping the DDP module and the group did not join the blocked gloo thread
