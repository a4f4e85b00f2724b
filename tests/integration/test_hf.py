"""The Hugging Face Trainer recovered in place with ``swiftrun.hf.recoverable(trainer)`` (examples/zoo/hf_trainer.py:
AdamW, a linear schedule with warm-up, accumulation over 2 micro-batches, clipping, dropout, the Trainer's own
shuffled DataLoader, a log every step, two epochs of 5 updates, 2 ranks).

Each run is compared rank by rank with plain torchrun's failure-free run: parameters, AdamW state, lr, schedule,
global step, epoch, the torch RNG state, and the loss of every logged step, bitwise. A failure between two steps
(after a rank's update, while the survivor logs) cuts that step's log: its gathers are skipped with a warning and
its loss is reported with the next log; the training state must still be bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, event_records, run, swiftrun_cmd
from tests.integration import framework_support
from tests.integration.framework_support import kill_at_a_random_moment, outcomes, reference_runs

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

SCRIPT = EXAMPLES / "zoo" / "hf_trainer.py"
WORLD = 2
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "10", "--no-dashboard"]
LOGS = ("extra.losses", "extra.train_loss")  # what a log cut by a recovery changes
LONG = ("--samples", "400")  # 25 updates per epoch: room for a kill from outside to land inside training


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_runs(tmp_path_factory, SCRIPT, WORLD)


def differences(save: Path, reference: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    return framework_support.differences(save, reference, WORLD, ignore)


def swiftrun_hf(tmp_path: Path, marker: str, *extra: str) -> tuple[Path, list[dict]]:
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(events), *extra, str(SCRIPT),
                            "--save-dir", str(save)), marker, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + (proc.stdout + proc.stderr)[-4000:]
    return save, event_records(events)


def cut_log_said(records: list[dict]) -> bool:
    return any("was skipped" in r["message"] for r in records if r["event"] == "warning")


@pytest.mark.timeout(300)
def test_failure_free_trainer_is_bitwise_torchruns(reference, tmp_path, marker):
    save, records = swiftrun_hf(tmp_path, marker)
    assert outcomes(records) == []
    assert not [r["message"] for r in records if r["event"] == "warning"]
    assert differences(save, reference()) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", [
    "1:3:forward:sigkill",  # the window's first forward, mid-epoch: rank 0 redoes the window, same batches
    pytest.param("0:7:backward:sigkill", marks=pytest.mark.extended),  # second epoch, the other rank
])
def test_a_rank_killed_inside_a_window_is_replaced_and_the_run_is_bitwise(fault, reference, tmp_path, marker):
    """The survivor's window is redone from its start (accumulated gradients dropped, the loss accumulated since
    the last log put back, its epoch re-entered at that window); the replacement receives everything and enters
    the epoch there too. Logs included, every rank ends bitwise as torchrun's failure-free run."""
    save, records = swiftrun_hf(tmp_path, marker, "--fault", fault)
    assert outcomes(records) == ["recovered"]
    assert differences(save, reference()) == []


@pytest.mark.timeout(300)
def test_a_rank_killed_after_the_last_update_of_an_epoch_is_replaced_at_the_next(reference, tmp_path, marker):
    """Rank 1 dies after its update of step 4, the last of epoch 0, while rank 0 completes the step and logs it:
    the recovery rolls forward and both ranks start epoch 1 (rank 0 again from the end of step 4, as the
    replacement received it). The training state is bitwise; the cut log is said."""
    save, records = swiftrun_hf(tmp_path, marker, "--fault", "1:4:after-step:sigkill")
    assert outcomes(records) == ["recovered"]
    assert differences(save, reference(), ignore=LOGS) == []
    if differences(save, reference()):
        assert cut_log_said(records)


@pytest.mark.timeout(360)
def test_an_outside_sigkill_at_a_random_moment(reference, tmp_path, marker):
    """SIGKILL from outside, at a moment the test does not choose. Set SWIFTRUN_TEST_SEED to replay a draw."""
    kill = kill_at_a_random_moment(SCRIPT, LONG, WORLD, FAST, range(2, 30), tmp_path, marker)
    seed, records, save = kill.seed, kill.records, kill.save
    if not outcomes(records):
        return  # it landed after training (the job had finished: no recovery, the victim may not have saved)
    assert outcomes(records) == ["recovered"], (seed, outcomes(records))
    assert differences(save, reference(LONG), ignore=LOGS) == [], seed
    if differences(save, reference(LONG)):
        assert cut_log_said(records), seed
