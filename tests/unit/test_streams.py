"""Each rank's own RNG streams: the runtime's encoding and choice (runtime/core/streams.py) and the launcher's
backups (launcher/streams.py), the Job handing a replacement its rank's backups."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from swiftrun.launcher.streams import StreamBackups
from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.core import streams
from swiftrun.runtime.core.recovery import Recovery
from swiftrun.runtime.core.txn import rng_state, set_rng_state
from tests.unit.test_job import SIGKILL, _no_dns, of, sends, swift_running  # noqa: F401 (_no_dns: autouse)
from swiftrun.launcher.actions import Spawn

pytestmark = pytest.mark.timeout(30)


def draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.randn()), float(np.random.rand())


def test_encoded_streams_survive_json_and_give_the_same_draws():
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    np.random.randn()  # a Gaussian cached in NumPy's legacy state
    state = rng_state()
    expected = draws()
    wire = json.loads(json.dumps(streams.encode(state)))
    draws()
    set_rng_state(streams.decode(wire))
    assert draws() == expected
    assert streams.same(state, streams.decode(wire)) and not streams.same(state, None)


def test_a_rank_takes_its_own_streams_when_they_are_per_rank_and_says_when_it_cannot():
    own, shared = {"who": "own"}, {"who": "source"}
    assert streams.choose(own, shared, per_rank=True, receives=True) == (own, True)
    assert streams.choose(None, shared, per_rank=True, receives=True) == (shared, False)
    # replica-equal streams: a receiving rank takes the source's, as the source's state
    assert streams.choose(own, shared, per_rank=False, receives=True) == (shared, True)
    assert streams.choose(own, shared, per_rank=False, receives=False) == (own, True)
    assert streams.choose(None, shared, per_rank=False, receives=False) == (shared, True)


def test_backups_keep_two_steps_and_detect_per_rank_streams():
    backups = StreamBackups()
    for step in range(4):
        backups.keep(0, step, "start", f"s{step}")
        backups.keep(1, step, "start", f"s{step}")  # the same streams on both ranks
    assert not backups.per_rank
    assert backups.of(0) == {"2": "s2", "3": "s3"}
    backups.keep(0, 4, "start", "a4")
    backups.keep(1, 4, "start", "b4")
    assert backups.per_rank


def test_a_provisional_backup_is_replaced_by_the_steps_own_and_dropped_for_a_script_drawing_after_its_update():
    backups = StreamBackups()
    backups.keep(0, 5, "start", "s5")
    backups.keep(0, 6, "update", "s6")
    assert backups.of(0) == {"5": "s5", "6": "s6"}
    backups.keep(0, 6, "start", "s6")
    backups.keep(0, 7, "update", "s7?")
    backups.keep(0, 7, "start", "s7")  # differs: this script draws after its update
    backups.keep(0, 8, "update", "s8?")  # not kept: it would be wrong
    assert backups.of(0) == {"6": "s6", "7": "s7"}
    backups.keep(0, 7, "update", "late")  # a start backup is never replaced by a provisional one
    assert backups.of(0) == {"6": "s6", "7": "s7"}
    backups.forget()
    assert backups.of(0) == {} and not backups.per_rank


def test_a_replacement_gets_its_ranks_own_backups_with_recover_and_every_rank_the_per_rank_flag():
    sim = swift_running(2, spares=0)
    for step in (3, 4):
        for rank in (0, 1):
            sim.event(sim.slot(rank), EventKind.RNG_BACKUP, step=step, at="start", state=f"r{rank}s{step}")
    assert sim.job.streams.per_rank
    survivor = sim.slot(0)
    actions = sim.exit(sim.slot(1), -SIGKILL)
    (spawn,) = of(actions, Spawn)
    sim.spawned(spawn.slot_id)
    sim.hello(spawn.slot_id)
    sim.event(survivor, EventKind.ABORTED)
    recover = sends(sim.event(spawn.slot_id, EventKind.JOINING), CommandKind.RECOVER)
    by_slot = {send.slot_id: send.args for send in recover}
    assert by_slot[spawn.slot_id]["own_rng"] == {"3": "r1s3", "4": "r1s4"}
    assert "own_rng" not in by_slot[survivor]
    assert by_slot[survivor]["per_rank_rng"] is True and by_slot[spawn.slot_id]["per_rank_rng"] is True


def test_a_backup_read_after_its_senders_exit_is_kept_until_the_replacement_joins():
    """A kill right after the update: the backup the rank sent first is often read only after its exit woke the
    launcher's loop. It is still that rank's, and goes to the replacement; once the replacement joined, late words
    of the dead process are not."""
    sim = swift_running(2, spares=0)
    for rank in (0, 1):
        sim.event(sim.slot(rank), EventKind.RNG_BACKUP, step=3, at="start", state=f"r{rank}s3")
    survivor, dead = sim.slot(0), sim.slot(1)
    (spawn,) = of(sim.exit(dead, -SIGKILL), Spawn)
    sim.event(dead, EventKind.RNG_BACKUP, step=4, at="update", state="r1s4")  # read after the exit
    sim.spawned(spawn.slot_id)
    sim.hello(spawn.slot_id)
    sim.event(survivor, EventKind.ABORTED)
    recover = sends(sim.event(spawn.slot_id, EventKind.JOINING), CommandKind.RECOVER)
    by_slot = {send.slot_id: send.args for send in recover}
    assert by_slot[spawn.slot_id]["own_rng"] == {"3": "r1s3", "4": "r1s4"}
    sim.event(dead, EventKind.RNG_BACKUP, step=5, at="start", state="stale")
    assert sim.job.streams.of(1) == {"3": "r1s3", "4": "r1s4"}


class _Holder:
    """The attributes Recovery's stream methods read, without a process group behind them (a pure unit)."""

    streams_held = Recovery.streams_held
    own_streams_for = Recovery.own_streams_for
    position = Recovery.position

    def __init__(self, completed: int, joining: bool, backups: dict[int, dict]) -> None:
        self.completed, self.partial, self.in_step, self.joining = completed, False, False, joining
        self.stream_backups = backups
        self._update_streams, self._draws_after_update = None, False
        self.txn = type("NoSnapshots", (), {"rng_for": staticmethod(lambda step: None)})()


def test_a_replacement_reports_the_steps_its_launcher_backups_hold_far_from_its_own_position():
    # its predecessor began steps 14 and 15; the fresh process stands before step 0 (live streams of step 0):
    # the HSDP consensus must hear of 14 and 15 to choose a point whose next step it can redo exactly
    replacement = _Holder(-1, True, {14: {"s": 14}, 15: {"s": 15}})
    assert replacement.streams_held(4) == [0, 14, 15]
    assert replacement.streams_held(2) == [14, 15]  # the newest when there is no room for all
    assert replacement.own_streams_for(15) == {"s": 15} and replacement.own_streams_for(16) is None
