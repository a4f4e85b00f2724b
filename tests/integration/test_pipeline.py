"""Pipeline recovery end to end: 4 stages (tests/scripts/pipeline.py), one rank killed, replayed.

A lost stage has no replica: its replacement loads the stage checkpoint its pipeline successor holds in memory
and replays the steps since, its receives served from its neighbours' logs; the idle survivors help it, each
computing a contiguous range of every step's micro-batches (runtime/pp/parallel.py). The recovered run must end bitwise
equal to the failure-free run on every rank, and the survivors must keep their processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run, run_killing_together, swiftrun_cmd

pytestmark = pytest.mark.integration

SCRIPT = str(REPO / "tests" / "scripts" / "pipeline.py")
FAST = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "10", "--no-dashboard"]
WORLD = 4
STEPS = 9  # stage checkpoints every 4 steps: at 0, 4, 8


def launch(save: Path, *extra: str, script: tuple[str, ...] = (), world: int = WORLD) -> list[str]:
    return swiftrun_cmd("--nproc-per-node", str(world), *FAST, "--event-log", str(save / "events.jsonl"), *extra,
                        SCRIPT, "--steps", str(STEPS), "--save-dir", str(save), *script)


def records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines() if line.strip()]


def survivor_pids(save: Path, lost: int | tuple[int, ...]) -> dict[int, set[int]]:
    """The pids each rank not in ``lost`` ran with (one per rank when the survivors kept their processes)."""
    lost = lost if isinstance(lost, tuple) else (lost,)
    pids: dict[int, set[int]] = {}
    for r in records(save):
        if r["event"] == "worker_state" and r.get("rank") not in (None, *lost) and r.get("pid"):
            pids.setdefault(r["rank"], set()).add(r["pid"])
    return pids


def assert_same(save: Path, reference: Path, world: int = WORLD) -> None:
    for rank in range(world):
        got = torch.load(save / f"rank{rank}.pt", weights_only=True)
        want = torch.load(reference / f"rank{rank}.pt", weights_only=True)
        for key, value in want["model"].items():
            assert torch.equal(got["model"][key], value), f"rank {rank}: {key} differs from the failure-free run"
        for index, entries in want["optimizer"]["state"].items():
            for name, value in entries.items():
                assert torch.equal(got["optimizer"]["state"][index][name], value), \
                    f"rank {rank}: optimizer state {index}.{name} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Failure-free runs under swiftrun, computed once per configuration."""
    cache: dict[tuple, Path] = {}

    def get(script: tuple[str, ...] = (), world: int = WORLD) -> Path:
        key = (script, world)
        if key not in cache:
            save = tmp_path_factory.mktemp("pp-reference")
            # failure-free: no spare needed (it would import torch for nothing)
            proc = run(launch(save, "--spares", "0", script=script, world=world), marker="pp-reference",
                       timeout=180)
            assert proc.returncode == 0, proc.stderr[-3000:]
            cache[key] = save
        return cache[key]

    return get


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault, script", [
    ("2:6:forward:sigkill", ()),  # a middle stage, two steps after its checkpoint
    ("3:5:backward:sigkill", ("--clip", "0.5")),  # the last stage; a cross-stage grad-norm all-reduce is replayed
    # the first stage, in the step of its checkpoint (extended: GPipe is in the fault campaign, first-stage loss
    # in the DP x PP and logging-group tests)
    pytest.param("0:4:step:sigkill", ("--schedule", "gpipe"), marks=pytest.mark.extended),
])
def test_lost_stage_is_replayed_bitwise(tmp_path, reference, fault, script):
    ref = reference(script)
    proc = run(launch(tmp_path, "--fault", fault, script=script), marker="pp-fault", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = int(fault.split(":")[0])
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [r["outcome"] for r in ended] == ["recovered"] and ended[0]["mode"] == "replay", ended
    (replay,) = [r for r in records(tmp_path) if r["event"] == "replay" and r["rank"] == lost]
    assert replay["helpers"] == [r for r in range(WORLD) if r != lost], replay  # every idle survivor helps
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, lost).values()), "a survivor was restarted"
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
def test_a_rank_lost_in_its_checkpoint_exchange_replays_from_the_previous_checkpoint(tmp_path, reference):
    """Rank 2 dies in its background checkpoint exchange of step 4, before any of it reached its holder (rank 3):
    rank 3 still holds the checkpoint of step 0 and its neighbours the logs since (the new checkpoint never
    completed), so rank 2 replays from step 0, bitwise."""
    ref = reference()
    proc = run(launch(tmp_path, "--fault", "2:4:exchange:sigkill"), marker="pp-exchange", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [r["outcome"] for r in ended] == ["recovered"] and ended[0]["mode"] == "replay", ended
    (replay,) = [r for r in records(tmp_path) if r["event"] == "replay" and r["rank"] == 2]
    assert replay["first"] == 0, replay
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, 2).values()), "a survivor was restarted"
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cap, helpers", [pytest.param("0", [], marks=pytest.mark.extended), ("1", [0])])
def test_parallel_replay_cap(tmp_path, reference, cap, helpers):
    """--parallel-replay 0 replays alone; 1 takes one helper (two ranges of two micro-batches, folded over a
    chain of two): both bitwise equal to the failure-free run."""
    ref = reference()
    proc = run(launch(tmp_path, "--parallel-replay", cap, "--fault", "2:6:forward:sigkill"), marker="pp-cap",
               timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (replay,) = [r for r in records(tmp_path) if r["event"] == "replay"]
    assert replay["helpers"] == helpers, replay
    assert_same(tmp_path, ref)


@pytest.mark.extended  # 6 ranks and a reference run of its own (~75 s); the shares: tests/unit/test_pp_parallel.py
@pytest.mark.timeout(300)
def test_two_stages_lost_at_once_each_replay_with_their_own_helpers(tmp_path, reference, marker):
    """6 stages, ranks 1 and 4 SIGKILLed at the same instant (each stopped after step 5's update, then killed back
    to back): two independent replay sets of one rank, each served from its own neighbours' logs. The idle
    survivors are shared out in contiguous shares, sets in plan order: ranks 0 and 2 help rank 1, ranks 3 and 5
    help rank 4, both replays at once. Bitwise the failure-free run; no survivor restarted."""
    world, lost, script = 6, (1, 4), ("--microbatches", "8")  # a schedule takes at least one per stage
    ref = reference(script, world)
    stops = [arg for r in lost for arg in ("--fault", f"{r}:5:after-step:sigstop")]
    code, out, err = run_killing_together(launch(tmp_path, *stops, script=script, world=world), marker,
                                          tmp_path / "events.jsonl", lost, timeout=250, SWIFTRUN_LOGLEVEL="info")
    assert code == 0, (out + err)[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [(r["outcome"], r["mode"]) for r in ended] == [("recovered", "replay")], ended
    replays = {r["rank"]: r for r in records(tmp_path) if r["event"] == "replay"}
    assert sorted(replays) == [1, 4] and all(r["ranks"] == [rank] for rank, r in replays.items()), replays
    assert {rank: r["helpers"] for rank, r in replays.items()} == {1: [0, 2], 4: [3, 5]}, replays
    for helper, leader in ((0, 1), (2, 1), (3, 4), (5, 4)):  # each helped both replayed steps (4 and 5)
        assert f"rank {helper} helped rank {leader} replay 2 step(s)" in err, err[-3000:]
    survivors = survivor_pids(tmp_path, lost)
    assert sorted(survivors) == [0, 2, 3, 5] and all(len(p) == 1 for p in survivors.values()), survivors
    assert_same(tmp_path, ref, world)


@pytest.mark.timeout(300)
def test_a_helper_lost_during_parallel_replay(tmp_path, reference):
    """Rank 2 is lost; rank 0 dies while helping replay step 5. The survivors blocked in the fold are released by
    the abort, stages 0 and 2 are each replayed (two replay sets: alone), and the run ends bitwise equal."""
    ref = reference()
    proc = run(launch(tmp_path, "--fault", "2:6:forward:sigkill", "--fault", "0:5:help:sigkill"), marker="pp-help",
               timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert ended and ended[-1]["outcome"] == "recovered", ended
    replays = {tuple(r["ranks"]) for r in records(tmp_path) if r["event"] == "replay"}
    assert {(0,), (2,)} <= replays, replays
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
@pytest.mark.extended
def test_survivors_that_undo_the_interrupted_step_end_bitwise(tmp_path, reference):
    """GPipe, the first stage killed in its backward: the last two stages already applied that step's update, the
    second did not (its gradient send to the dead rank failed). The replay ends at the step before, so stages 2 and
    3 undo their update (recovery_end's ``undo``); an inverted AdamW step is a few ULP off (the campaign saw
    1-2e-7 relative on every rank, classed CLOSE), so a pipeline keeps a pre-step copy by default: bitwise."""
    ref = reference(("--schedule", "gpipe"))
    proc = run(launch(tmp_path, "--fault", "0:6:backward:sigkill", script=("--schedule", "gpipe")),
               marker="pp-undo", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [(r["outcome"], r["mode"]) for r in ended] == [("recovered", "replay")] and ended[0]["undo"], ended
    assert ended[0]["inexact"] is None, ended
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
def test_rank_lost_while_the_first_group_connects(tmp_path, reference):
    """Every rank registered; rank 1 dies before it builds the first process group, so the others' build fails
    when the store wait times out. That failed build used up torch's name for the default group: without a reset
    the survivors' next group had another name than the replacement's and both waited for each other's keys until
    the connect timeout, then the job stopped (fault campaign, a kill 0.1 s after start-up). Now the recovery goes
    through: nothing was trained yet, so the replacement starts from its own initial state, no replay. And the
    survivors' wait in the store for the dead rank's address is released by the abort, not by the 30 s connect
    timeout (the generation's store connection is aborted with its group)."""
    ref = reference()
    proc = run(launch(tmp_path, "--fault", "1:0:connect:sigkill"), marker="pp-connect", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [r["outcome"] for r in ended] == ["recovered"], ended
    (abort,) = [r for r in records(tmp_path) if r["event"] == "recovery_phase" and r["phase"] == "abort"]
    assert abort["duration"] < 15, abort  # 30 s (the connect timeout) before
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, 1).values()), "a survivor was restarted"
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
def test_two_adjacent_stages_lost_is_refused_loudly(tmp_path):
    """Stages 1 and 2 die together: stage 1's gradients were logged only by stage 2. No silent replay: the job
    stops (no --max-restarts) naming the reason."""
    proc = run(launch(tmp_path, "--fault", "1:5:step:sigkill", "--fault", "2:5:step:sigkill"), marker="pp-adjacent",
               timeout=220)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "lost together" in text, text[-3000:]


@pytest.mark.timeout(240)
def test_stage_with_a_replica_recovers_from_it(tmp_path, reference):
    """2 stages x 2 replicas (DDP on each stage's subgroup, PipelineStage on each pipeline's subgroup): the lost
    rank's stage has a surviving replica, so it is copied, not replayed; the script's subgroups are re-created
    and DDP and the stage are pointed at them."""
    script = ("--dp", "2")
    ref = reference(script)
    proc = run(launch(tmp_path, "--fault", "3:6:backward:sigkill", script=script), marker="pp-hybrid", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [(r["outcome"], r["mode"], r["source_rank"]) for r in ended] == [("recovered", "replica", 1)], ended
    assert not any(r["event"] == "replay" for r in records(tmp_path))
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, 3).values()), "a survivor was restarted"
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage, stop_at, script", [
    (0, "6:forward", ()),  # the first stage: its replicas read the logged gradients of stage 1
    # the last stage, in backward, with a pipeline-wide grad-norm all-reduce served from the logs while the
    # stage's DDP all-reduce runs live, under GPipe (extended: a reference run of its own)
    pytest.param(1, "5:backward", ("--clip", "0.5", "--schedule", "gpipe"), marks=pytest.mark.extended),
])
def test_every_replica_of_a_stage_lost_together_replays_in_lockstep(tmp_path, reference, marker, stage, stop_at,
                                                                     script):
    """2 stages x 2 replicas, both replicas of one stage SIGKILLed at the same instant: nobody holds that stage's
    state, so each replacement replays it from its checkpoint in its own pipeline's next rank, served from that
    pipeline's logs, while the stage's DDP gradient all-reduce runs live between the two replacements. Bitwise
    the failure-free run; the other stage's ranks keep their processes.

    The same instant, deterministically: each of the two ranks stops itself (SIGSTOP fault) at the same point of
    the same step; once the kernel reports both stopped the test SIGKILLs them back to back. (Two sigkill faults
    can land apart: a rank that lags is aborted at its next step start, recovers from its dying replica, and the
    replica path runs instead.)"""
    script = ("--dp", "2", *script)
    ref = reference(script)
    lost = (stage, stage + 2)
    stops = [arg for r in lost for arg in ("--fault", f"{r}:{stop_at}:sigstop")]
    code, out, err = run_killing_together(launch(tmp_path, *stops, script=script), marker,
                                          tmp_path / "events.jsonl", lost)
    assert code == 0, (out + err)[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert ended[-1]["outcome"] == "recovered" and ended[-1]["mode"] == "replay", ended
    replays = [r for r in records(tmp_path) if r["event"] == "replay"]
    assert sorted(r["rank"] for r in replays) == list(lost) and all(r["ranks"] == list(lost) for r in replays), replays
    survivors = survivor_pids(tmp_path, lost)
    assert sorted(survivors) == [1 - stage, 3 - stage] and all(len(p) == 1 for p in survivors.values()), survivors
    assert_same(tmp_path, ref)


@pytest.mark.extended  # the refusal is a pure plan (tests/unit/test_pp_plan.py); this is the end to end path
@pytest.mark.timeout(240)
def test_every_replica_of_a_stage_and_one_replica_of_its_neighbour_restart_every_worker(tmp_path, reference, marker):
    """Ranks 0 and 2 (stage 0) and rank 1 (stage 1 of replica 0) lost at the same instant: rank 0's replay needs
    the gradients rank 1 logged, lost with it, so rank 1 would have to replay too, while its replica rank 3 keeps
    its state and cannot run the stage's all-reduce of those steps again. The plan refuses with that reason and,
    with --max-restarts 1, every worker restarts (from scratch: the script keeps no checkpoint): bitwise the
    failure-free run, never a silently wrong model."""
    script = ("--dp", "2")
    ref = reference(script)
    stops = ["--fault", "0:6:forward:sigstop", "--fault", "2:6:forward:sigstop", "--fault", "1:5:after-step:sigstop"]
    code, out, err = run_killing_together(launch(tmp_path, "--max-restarts", "1", *stops, script=script), marker,
                                          tmp_path / "events.jsonl", (0, 1, 2))
    assert code == 0, (out + err)[-3000:]
    assert "replica(s) 3 survive" in out + err, (out + err)[-3000:]
    assert [r["event"] for r in records(tmp_path)].count("restart") == 1
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, budget, fault, script, groups, columns", [
    (4, 10, "2:6:forward:sigkill", (), [[0, 1], [2, 3]], {2: [0], 3: [1]}),
    # the first group, in backward, under GPipe with a cross-stage grad-norm all-reduce: the chain's first helper
    # takes the script's micro-batches, its last the logged gradients of stage 2
    pytest.param(4, 10, "0:5:backward:sigkill", ("--schedule", "gpipe", "--clip", "0.5"), [[0, 1], [2, 3]],
                 {0: [2], 1: [3]}, marks=pytest.mark.extended),
    # 6 stages in three groups: the four idle ranks make two chains, (0, 1) and (4, 5); 8 micro-batches in three
    # ranges, each column's fold passing through both chains (rank 2 -> 0 -> 4 -> 2)
    pytest.param(6, 20, "2:6:forward:sigkill", ("--microbatches", "8"), [[0, 1], [2, 3], [4, 5]],
                 {2: [0, 4], 3: [1, 5]}, marks=pytest.mark.extended),
])
def test_selective_logging_replays_the_lost_stage_logging_group(tmp_path, reference, world, budget, fault, script,
                                                                 groups, columns):
    """A 10 KiB budget logs one boundary of three: groups [0,1] [2,3]. Killing rank 2 replays ranks 2 and 3
    together (rank 3 rolls back to its own checkpoint copy; they talk live), bitwise. The two idle ranks form one
    chain, a copy of the group's two stages computing half of every replayed step's micro-batches, activations and
    gradients flowing live between them; each member folds its column's gradients in micro-batch order. Each
    helper must have helped every replayed step (its log line), the survivors keep their processes."""
    ref = reference(script, world)
    lost = int(fault.split(":")[0])
    proc = run(launch(tmp_path, "--log-budget", f"{budget}KiB", "--fault", fault, script=script, world=world),
               marker="pp-groups", timeout=220, SWIFTRUN_LOGLEVEL="info")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (plan,) = [r for r in records(tmp_path) if r["event"] == "log_plan"]
    assert plan["groups"] == groups and plan["peak_log_bytes"] <= budget * 1024, plan
    replays = {r["rank"]: r for r in records(tmp_path) if r["event"] == "replay"}
    assert {tuple(r["ranks"]) for r in replays.values()} == {tuple(columns)}, replays
    assert {rank: r["helpers"] for rank, r in replays.items()} == columns, replays
    for member, column in columns.items():
        steps = replays[member]["last"] - replays[member]["first"] + 1
        for helper in column:
            assert f"rank {helper} helped rank {member} replay {steps} step(s)" in proc.stderr, proc.stderr[-3000:]
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, lost).values()), "a survivor was restarted"
    assert_same(tmp_path, ref, world)


@pytest.mark.extended  # the abort releasing blocked ranks is in the default suite (test_a_helper_lost_during_...)
@pytest.mark.timeout(300)
def test_a_chain_helper_lost_during_a_logging_groups_replay(tmp_path, reference):
    """Groups [0,1] [2,3], rank 2 killed; rank 1, running stage 3's copy in the chain, dies while helping step 5.
    The ranks blocked in the chain's traffic are released by the abort; now both groups must replay (rank 1's
    group, and rank 2's, which needs rank 1's logs): all four ranks together from --stage-ckpt-dir, with no idle
    rank left for a chain (said in a log line), and the run ends bitwise equal."""
    ref = reference()
    proc = run(launch(tmp_path, "--log-budget", "10KiB", "--stage-ckpt-dir", str(tmp_path / "ckpt"),
                      "--fault", "2:6:forward:sigkill", "--fault", "1:5:help:sigkill"), marker="pp-chain-help",
               timeout=280, SWIFTRUN_LOGLEVEL="info")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 replays its stage with helpers [1]" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 replays with ranks [1, 2, 3] without helpers: fewer idle ranks" in proc.stderr, \
        proc.stderr[-3000:]
    replays = {tuple(r["ranks"]) for r in records(tmp_path) if r["event"] == "replay"}
    assert {(2, 3), (0, 1, 2, 3)} <= replays, replays
    assert_same(tmp_path, ref)


@pytest.mark.extended  # the agreement between members; the single-rank side-effect check is in tests/unit
@pytest.mark.timeout(240)
def test_a_logging_group_replays_alone_when_one_members_forward_has_side_effects(tmp_path, reference):
    """Groups [0,1] [2,3], rank 2 killed; stage 3's module counts its forwards (a side effect that changes no
    result). Rank 3 sees it at the first replayed forward and tells rank 2: both release their helpers (a chain
    needs every column) and the group replays alone, bitwise."""
    ref = reference()  # the counter changes nothing the model computes
    proc = run(launch(tmp_path, "--log-budget", "10KiB", "--fault", "2:6:forward:sigkill",
                      script=("--count-forwards", "3")), marker="pp-groups-side", timeout=220,
               SWIFTRUN_LOGLEVEL="info")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 3 replays its stage without helpers: its forward changes .forwards" in proc.stderr, \
        proc.stderr[-3000:]
    assert "rank 2 replays its stage without helpers: rank 3: its forward changes .forwards" in proc.stderr, \
        proc.stderr[-3000:]
    for helper, member in ((0, 2), (1, 3)):
        assert f"rank {helper} helped rank {member} replay 0 step(s)" in proc.stderr, proc.stderr[-3000:]
    assert_same(tmp_path, ref)


@pytest.mark.timeout(240)
def test_adjacent_stages_lost_replay_together_from_the_stage_checkpoint_dir(tmp_path, reference):
    """With --stage-ckpt-dir the checkpoint that died with its holder is read from disk: stages 1 and 2 replay
    together (the logs at the set's edges are held by ranks 0 and 3), bitwise."""
    ref = reference()
    proc = run(launch(tmp_path, "--stage-ckpt-dir", str(tmp_path / "ckpt"), "--fault", "1:5:step:sigkill",
                      "--fault", "2:5:step:sigkill"), marker="pp-disk", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    replays = {tuple(r["ranks"]) for r in records(tmp_path) if r["event"] == "replay"}
    assert (1, 2) in replays, replays
    assert_same(tmp_path, ref)


# ---------------------------------------------------------------------- hand-written P2P pipelines

P2P_SCRIPT = str(REPO / "tests" / "scripts" / "pipeline_p2p.py")
P2P_ARGS = ("--clip", "0.5")  # dropout on, and a cross-stage grad-norm all-reduce the replay is served


def launch_p2p(save: Path, *extra: str) -> list[str]:
    return swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(save / "events.jsonl"), *extra,
                        P2P_SCRIPT, "--steps", str(STEPS), "--save-dir", str(save), *P2P_ARGS)


@pytest.fixture(scope="module")
def p2p_reference(tmp_path_factory) -> Path:
    save = tmp_path_factory.mktemp("p2p-reference")
    proc = run(launch_p2p(save, "--spares", "0"), marker="p2p-reference", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return save


@pytest.mark.timeout(420)
@pytest.mark.parametrize("fault", [
    "2:6:forward:sigkill",  # a middle stage, in the forward of its micro-batch loop, two steps after its checkpoint
    pytest.param("3:5:backward:sigkill", marks=pytest.mark.extended),  # the last stage, in its backward
])
def test_hand_written_p2p_stage_is_replayed_bitwise(tmp_path, p2p_reference, fault):
    """The script moves tensors itself (dist.isend/recv, batch_isend_irecv of P2POps) and registers
    swiftrun.Stage: the lost stage is replayed from the logged traffic, bitwise, survivors keep their processes."""
    proc = run(launch_p2p(tmp_path, "--fault", fault), marker="p2p-fault", timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lost = int(fault.split(":")[0])
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert [(r["outcome"], r["mode"]) for r in ended] == [("recovered", "replay")], ended
    assert any(r["event"] == "replay" and r["rank"] == lost for r in records(tmp_path))
    assert all(len(pids) == 1 for pids in survivor_pids(tmp_path, lost).values()), "a survivor was restarted"
    assert_same(tmp_path, p2p_reference)


P2P_DP_ARGS = ("--dp", "2", "--schedule", "1f1b")  # 2 stages x 2 replicas, gradients all-reduced by the script


@pytest.mark.extended  # the same paths as train_pp --dp 2 (test_train_pp.py), here for a script moving its own tensors
@pytest.mark.timeout(420)
@pytest.mark.parametrize("lost", [(1,), (0, 2)], ids=["one-replica", "every-replica"])
def test_hand_written_p2p_pipeline_with_replicas(tmp_path, tmp_path_factory, marker, lost):
    """A Megatron-style script: P2P between stages, each stage's gradients averaged over its replicas by the
    script's own all-reduce of a flat buffer. One replica lost: its state comes from the surviving replica (no
    replay). Every replica of stage 0 lost at the same instant: they replay in lockstep from their stage
    checkpoints, the script's all-reduce live between them. Bitwise the failure-free run, survivors kept."""
    reference = tmp_path_factory.mktemp("p2p-dp-reference")
    proc = run(swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--spares", "0", P2P_SCRIPT, "--steps", str(STEPS),
                            "--save-dir", str(reference), *P2P_ARGS, *P2P_DP_ARGS), marker="p2p-dp-reference",
               timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stops = [arg for r in lost for arg in ("--fault", f"{r}:6:forward:sigstop")]
    cmd = swiftrun_cmd("--nproc-per-node", str(WORLD), *FAST, "--event-log", str(tmp_path / "events.jsonl"), *stops,
                       P2P_SCRIPT, "--steps", str(STEPS), "--save-dir", str(tmp_path), *P2P_ARGS, *P2P_DP_ARGS)
    code, out, err = run_killing_together(cmd, marker, tmp_path / "events.jsonl", lost)
    assert code == 0, (out + err)[-3000:]
    ended = [r for r in records(tmp_path) if r["event"] == "recovery_end"]
    assert ended and all(r["outcome"] == "recovered" for r in ended), ended
    assert ended[-1]["mode"] == ("replica" if len(lost) == 1 else "replay"), ended
    survivors = survivor_pids(tmp_path, lost)
    assert len(survivors) == WORLD - len(lost) and all(len(p) == 1 for p in survivors.values()), survivors
    assert_same(tmp_path, reference)
    rank0, rank2 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True)["model"] for r in (0, 2))
    assert all(torch.equal(rank0[k], rank2[k]) for k in rank0), "the replicas of stage 0 differ"
