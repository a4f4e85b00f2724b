"""The zoo (examples/zoo/): realistic training scripts, failure-free and with one fixed fault each.

Each script saves every rank's final state in one flat format (examples/zoo/_common.py): parameters, every
buffer (non-persistent too), optimizer state, every param group's lr/momentum/betas, scheduler and scaler state,
EMA weights, script counters, the torch RNG state. A run is compared rank by rank with plain torchrun's
failure-free run of the same configuration (computed once per session): bitwise, or within 1e-6 relative when
the recovery undid an update. The faults target what MLP-only tests cannot see: BatchNorm buffers, an lr that
scheduler.step() wrote into param_groups, dropout with a DataLoader worker, an EMA, and collectives the script
issues outside the guard (evaluation all-reduce, checkpoint barrier). docs/FAULT_CAMPAIGN.md has the random
campaign built on the same scripts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import EXAMPLES, run, run_torchrun, swiftrun_cmd

sys.path.insert(0, str(EXAMPLES / "zoo"))
from _common import differing_keys, kind_rel_diff  # noqa: E402

pytestmark = pytest.mark.integration

ZOO = EXAMPLES / "zoo"
WORLD = 2
# no SIGSTOP faults here, so a heartbeat timeout that stays robust on a loaded 2-core machine
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "10", "--no-dashboard"]
ARGS = {  # short runs: a few seconds each beyond importing torch
    "cnn_bn": ("--steps", "20"),
    "gpt": ("--steps", "16"),
    "ema": ("--steps", "16"),
    "eval_ckpt": ("--steps", "40"),
    "sync_bn": ("--steps", "16"),
    "contrastive": ("--steps", "16"),
    "rank_dropout": ("--steps", "16"),
    "zero": ("--steps", "12"),
    "fsdp_1d": ("--steps", "8"),
    "powersgd": ("--steps", "12"),
    "streaming": ("--steps", "12"),
    "accelerate_loop": ("--steps", "12"),
    "fabric_loop": ("--steps", "12"),
}


def load(save: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(save / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="session")
def zoo_reference(tmp_path_factory):
    """Plain torchrun's failure-free result of (script, extra args), computed once per session."""
    cache: dict[tuple, Path] = {}

    def get(script: str, extra: tuple[str, ...] = ()) -> Path:
        key = (script, extra)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"zoo-ref-{script}")
            proc = run_torchrun(["torchrun", "--standalone", "--nproc-per-node", str(WORLD), str(ZOO / f"{script}.py"),
                        *ARGS[script], *extra, "--save-dir", str(out / "save")], marker="zoo-reference",
                       timeout=180)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[key] = out / "save"
        return cache[key]

    return get


def swiftrun_zoo(script: str, tmp_path: Path, marker: str, faults: tuple[str, ...] = (),
                 extra: tuple[str, ...] = ()) -> tuple[Path, list[dict]]:
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    fault_args = [a for f in faults for a in ("--fault", f)]
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(events), *fault_args,
                            str(ZOO / f"{script}.py"), *ARGS[script], *extra, "--save-dir", str(save)),
               marker, timeout=150)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return save, records


def assert_same_as_reference(save: Path, reference: Path, records: list[dict]) -> None:
    results, expected = load(save), load(reference)
    undone = any(r["event"] == "recovery_end" and r.get("mode") == "undo" for r in records)
    problems = []
    for rank in range(WORLD):
        diff = differing_keys(results[rank], expected[rank])
        if not diff:
            continue
        floats = [k for k in diff if k in expected[rank] and expected[rank][k].is_floating_point()]
        exact = [k for k in diff if k not in floats]
        # of the magnitude of the entry's kind, as the fault campaign judges: an inverted update is exact to a
        # few ULP of the values it handled, which a near-zero tensor's own magnitude would blow up
        worst = kind_rel_diff(results[rank], expected[rank], floats)
        if undone and not exact and worst <= 1e-6:
            continue
        problems.append(f"rank {rank}: {len(diff)} entries differ (max rel diff {worst:.3g} over floats; "
                        f"undone: {undone}): {', '.join(sorted(exact + floats, key=_params_last)[:8])}")
    assert not problems, "\n".join(problems)


def _params_last(key: str) -> tuple[bool, str]:
    """Order differing keys so the telling ones (buffers, lr, counters, RNG) come before the parameters."""
    return key.startswith(("model.param.", "opt0.state.")), key


def recoveries(records: list[dict]) -> list[dict]:
    return [r for r in records if r["event"] == "recovery_end"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", [s if s == "gpt" else pytest.param(s, marks=pytest.mark.extended)
                                    for s in sorted(ARGS)])
def test_failure_free_zoo_matches_torchrun(script, zoo_reference, tmp_path, marker):
    """Turning recovery on changes nothing: every rank's final state is bitwise torchrun's."""
    save, records = swiftrun_zoo(script, tmp_path, marker)
    assert not recoveries(records)
    results, expected = load(save), load(zoo_reference(script))
    for rank in range(WORLD):
        assert differing_keys(results[rank], expected[rank]) == [], f"rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", ["sync_bn", "contrastive"])
def test_a_warm_spare_runs_forward_collectives_on_the_jobs_group(script, zoo_reference, tmp_path, marker):
    """torch.distributed.nn.functional binds ``group=group.WORLD`` as a default argument when imported; a spare's
    warm-up imported it under its fake group, so the replacement's forward all-reduce (sync_bn: statistics of the
    global batch) returned local values and its all_gather (contrastive: a loss over the global batch) failed on
    a group that is not in the world map. Rank 1 dies mid-forward at step 5 and a warm spare (the default
    --spares 1) takes over: the job must end bitwise as the failure-free torchrun run, with one recovery."""
    save, records = swiftrun_zoo(script, tmp_path, marker, faults=("1:5:forward:sigkill",))
    assert [r["outcome"] for r in recoveries(records)] == ["recovered"]
    assert_same_as_reference(save, zoo_reference(script), records)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["1:5:forward:sigkill", "1:6:after-step:sigkill"])
def test_a_replacement_continues_with_its_own_ranks_random_streams(fault, zoo_reference, tmp_path, marker):
    """Every rank draws dropout masks (torch) and an input jitter (Python) from a stream seeded per rank. Killed
    mid-forward, rank 1's step is redone from its own streams as of that step's start; killed after its update
    (rank 0 may finish the step: roll-forward), from its streams as of the next step's start, backed up after
    its update. Either way the job ends bitwise as the failure-free run, RNG states included, with no warning;
    before the backups the replacement took rank 0's streams and both ranks drew the same masks."""
    save, records = swiftrun_zoo("rank_dropout", tmp_path, marker, faults=(fault,))
    assert [r["outcome"] for r in recoveries(records)] == ["recovered"]
    assert [r["message"] for r in records if r["event"] == "warning"] == []
    assert_same_as_reference(save, zoo_reference("rank_dropout"), records)


@pytest.mark.timeout(300)
def test_own_streams_that_exist_nowhere_are_said_not_silently_replaced(zoo_reference, tmp_path, marker):
    """The script also draws between steps, outside the guard: a backup taken at the update is then not the next
    step's start (noticed at step 1 and never used again). Rank 1 dies after its update of step 6; where rank 0
    finished the step, the recovery rolls forward and rank 1's streams as of step 7 exist nowhere. The job must
    then say so (a warning naming rank 1 and step 7); where rank 0 had not finished, step 6 is redone from its
    start's backup and the run is exact. Never a silent difference."""
    extra = ("--draw-between-steps",)
    save, records = swiftrun_zoo("rank_dropout", tmp_path, marker, faults=("1:6:after-step:sigkill",), extra=extra)
    warnings = [r["message"] for r in records if r["event"] == "warning"]
    if warnings:
        assert any("rank 1's streams as of step 7 were backed up nowhere" in w for w in warnings), warnings
    else:
        assert_same_as_reference(save, zoo_reference("rank_dropout", extra), records)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "named"), [
    ("zero", "ZeroRedundancyOptimizer shards the optimizer state"),
    ("powersgd", "the PowerSGD comm hook keeps per-rank state"),
])
def test_per_rank_layouts_train_and_a_failure_restarts_every_worker_with_the_layout_named(
        script, named, zoo_reference, tmp_path, marker):
    """zero: ZeroRedundancyOptimizer captured the default group before swiftrun.Run rebuilt it (its first step
    failed: "Group ... is not registered"), and a lost rank's shard exists nowhere else. powersgd: the comm hook's
    error feedback is per rank (every recovery ended in a collective-mismatch abort, 16 in 3 s). Run() names the
    layout, and rank 1's SIGKILL at step 4 restarts every worker (--max-restarts 1) instead of a recovery that
    cannot be exact: the script starts over and ends bitwise as torchrun's failure-free run."""
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(events), "--max-restarts", "1",
                            "--fault", "1:4:forward:sigkill", str(ZOO / f"{script}.py"), *ARGS[script],
                            "--save-dir", str(save)), marker, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    assert not recoveries(records) and [r["event"] for r in records].count("restart") == 1
    assert named in proc.stderr
    assert "restarting every worker" in proc.stderr and "in-place recovery is impossible" in proc.stderr
    assert_same_as_reference(save, zoo_reference(script), records)


@pytest.mark.timeout(300)
def test_a_failure_of_a_1d_fsdp_job_stops_at_once_with_the_reason(tmp_path, marker):
    """FSDP2 over every rank: no replica holds a lost rank's shards. Run() warns, and rank 1's SIGKILL at step 3
    stops the job (no --max-restarts) naming FSDP, instead of "no surviving replica holds a consistent state" or
    a stall. A fault in the backward pass cannot fire for a sharded model and is refused at Run()."""
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--fault", "1:3:forward:sigkill",
                            str(ZOO / "fsdp_1d.py"), *ARGS["fsdp_1d"], "--save-dir", str(tmp_path / "save")),
               marker, timeout=150)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "stopping the job" in proc.stderr and "FSDP2 (fully_shard)" in proc.stderr, proc.stderr[-3000:]
    assert "no surviving replica" not in proc.stderr
    refused = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--fault", "1:3:backward:sigkill",
                               str(ZOO / "fsdp_1d.py"), *ARGS["fsdp_1d"], "--save-dir", str(tmp_path / "save2")),
                  marker, timeout=150)
    assert refused.returncode == 1 and "cannot fire for a sharded model" in refused.stderr


@pytest.mark.timeout(300)
def test_a_streaming_loaders_position_is_said_to_be_lost_at_the_start_and_at_the_recovery(tmp_path, marker):
    """An IterableDataset read with next(it) inside the guard: its position cannot travel, so the recovery is not
    exact. swiftrun says so when training starts and again when the recovery ends, in the event log."""
    _, records = swiftrun_zoo("streaming", tmp_path, marker, faults=("1:5:forward:sigkill",))
    assert [r["outcome"] for r in recoveries(records)] == ["recovered"]
    warnings = [r["message"] for r in records if r["event"] == "warning"]
    assert any(w.startswith("the job reads a streaming IterableDataset (RecordStream)") for w in warnings), warnings
    assert any(w.startswith("recovery 1 is not exact: the job reads a streaming IterableDataset") for w in warnings)


@pytest.mark.timeout(300)
def test_batchnorm_rank_killed_mid_forward(zoo_reference, tmp_path, marker):
    """Rank 1 dies in its forward pass; rank 0's forward already updated its BatchNorm running statistics (and
    num_batches_tracked) for the interrupted step. The redone step must not count that batch twice."""
    save, records = swiftrun_zoo("cnn_bn", tmp_path, marker, faults=("1:6:forward:sigkill",))
    assert recoveries(records) and recoveries(records)[-1]["outcome"] == "recovered"
    assert_same_as_reference(save, zoo_reference("cnn_bn"), records)


@pytest.mark.timeout(300)
def test_lr_of_a_step_redone_after_an_undo(zoo_reference, tmp_path, marker):
    """Rank 1 dies right after optimizer.step() of step 9; rank 0 runs scheduler.step() (which crosses a
    MultiStepLR milestone and writes the new lr into param_groups) and blocks in the evaluation all-reduce inside
    the guard. No rank finished the step: the update is undone and step 9 redone, with step 9's lr."""
    extra = ("--inside-guard",)
    save, records = swiftrun_zoo("eval_ckpt", tmp_path, marker, faults=("1:9:after-step:sigkill",), extra=extra)
    assert [r.get("mode") for r in recoveries(records)] == ["undo"]
    # --inside-guard changes where the evaluation runs, not what it computes: same reference as without it
    assert_same_as_reference(save, zoo_reference("eval_ckpt"), records)


@pytest.mark.timeout(300)
def test_gpt_with_dataloader_worker_killed_mid_step(zoo_reference, tmp_path, marker):
    """Rank 1 dies in its backward pass (second micro-batch) while a DataLoader worker feeds it and dropout draws
    from the global RNG: the redone step must see the same batch and the same dropout masks."""
    save, records = swiftrun_zoo("gpt", tmp_path, marker, faults=("1:7:backward:sigkill",))
    assert recoveries(records)
    assert_same_as_reference(save, zoo_reference("gpt"), records)


@pytest.mark.timeout(300)
def test_ema_rank_killed_after_its_step(zoo_reference, tmp_path, marker):
    """Rank 0 dies right after optimizer.step() (before its EMA update and scheduler.step()); rank 1 finishes
    the step. The EMA weights and n_averaged must end as without the failure."""
    save, records = swiftrun_zoo("ema", tmp_path, marker, faults=("0:6:after-step:sigkill",))
    assert recoveries(records)
    assert_same_as_reference(save, zoo_reference("ema"), records)


@pytest.mark.timeout(300)
def test_eval_ckpt_rank_killed_in_the_checkpoint_barrier_after_the_guard(zoo_reference, tmp_path, marker):
    """The checkpoint barrier comes after ``with run.guard():`` (the usual layout). Rank 1 SIGKILLs itself right
    before it at step 9; rank 0 is blocked in it, outside the guard. A barrier carries no data: the job ends
    exactly as without the failure, with each evaluation counted once."""
    save, records = swiftrun_zoo("eval_ckpt", tmp_path, marker, extra=("--crash", "1:9:barrier"))
    assert recoveries(records)
    assert_same_as_reference(save, zoo_reference("eval_ckpt"), records)
    checkpoint = torch.load(save / "ckpt" / "latest.pt", weights_only=False)
    assert checkpoint["step"] == 40 and checkpoint["history"]["evals"] == 8


@pytest.mark.timeout(300)
def test_registered_state_fed_by_a_skipped_evaluation_all_reduce_is_refused_loudly(tmp_path, marker):
    """Rank 1 dies right before the evaluation all-reduce after the guard. Rank 0 recovers there and the
    all-reduce is skipped: its result is rank 0's local accuracy, which the script then adds to its *registered*
    history. No run can make that exact (the replacement never runs step 9's evaluation), so the verification at
    the next step names the entries that diverged and the job stops instead of training on."""
    events = tmp_path / "events.jsonl"
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(events),
                            str(ZOO / "eval_ckpt.py"), *ARGS["eval_ckpt"], "--crash", "1:9:eval",
                            "--save-dir", str(tmp_path / "save")), marker, timeout=150)
    assert proc.returncode == 1
    assert "replicas differ before step 10" in proc.stderr and "user.eval_sum" in proc.stderr, proc.stderr[-3000:]
    assert "was skipped" in proc.stderr  # the skipped all-reduce was named at its call site


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["1:5:forward:sigkill",
                                   pytest.param("0:7:after-step:sigkill", marks=pytest.mark.extended)])
def test_a_fabric_loop_is_recovered_in_place(fault, zoo_reference, tmp_path, marker):
    """What fabric.setup() returned (a _FabricModule around Fabric's own DDP, a _FabricOptimizer) is registered as
    it is; Fabric joined the job's group itself. Killed mid-forward, or rank 0 after its update of the last step
    of epoch 0: the job ends bitwise as torchrun's failure-free run of the same script."""
    pytest.importorskip("lightning")
    save, records = swiftrun_zoo("fabric_loop", tmp_path, marker, faults=(fault,))
    assert [r["outcome"] for r in recoveries(records)] == ["recovered"]
    assert [r["message"] for r in records if r["event"] == "warning"] == []
    assert_same_as_reference(save, zoo_reference("fabric_loop"), records)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["1:5:forward:sigkill",
                                   pytest.param("1:7:after-step:sigkill", marks=pytest.mark.extended)])
def test_an_accelerate_loop_is_recovered_in_place_accumulation_count_included(fault, zoo_reference, tmp_path,
                                                                              marker):
    """What accelerator.prepare() returned is registered as it is, and one accelerator.accumulate window of 2
    micro-batches is one step. Killed in the window's first forward (step 5), or after its update of the last
    step of epoch 0 (step 7): the job ends bitwise as torchrun's failure-free run, Accelerate's micro-batch count
    included (a redone window counted its micro-batches twice before it travelled with the state)."""
    pytest.importorskip("accelerate")
    save, records = swiftrun_zoo("accelerate_loop", tmp_path, marker, faults=(fault,))
    assert [r["outcome"] for r in recoveries(records)] == ["recovered"]
    assert [r["message"] for r in records if r["event"] == "warning"] == []
    assert_same_as_reference(save, zoo_reference("accelerate_loop"), records)
