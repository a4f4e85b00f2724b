"""examples/train_pp.py, the pipeline-parallel reference script: failure-free runs only.

The single-process run is the reference: it does the pipeline's arithmetic (micro-batches in order, one division
by M), so every schedule with one replica must end bitwise equal to it. Two runs of one command are bitwise
equal (optimizer state too), and a run resumed from --ckpt-dir equals one that never stopped. Each launch costs
a few seconds (every rank imports torch), so runs are short and shared between tests.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.helpers import (EXAMPLES, processes_with_marker, run, run_killing_together, run_torchrun, swiftrun_cmd,
                           wait_until)

pytestmark = pytest.mark.integration

TRAIN_PP = EXAMPLES / "train_pp.py"
STEPS = 6
COMMON = ("--steps", str(STEPS), "--layers", "4", "--hidden", "16", "--batch", "16", "--microbatches", "4",
          "--optimizer", "adam", "--dropout", "0.2")
TIMEOUT = 120


def torchrun(nproc: int, *args: str) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), str(TRAIN_PP), *args]


def launch(cmd: list[str], marker: str) -> str:
    proc = (run_torchrun if cmd[0] == "torchrun" else run)(cmd, marker, timeout=TIMEOUT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def load(save: Path) -> dict[str, dict]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted(save.glob("rank*.pt"))}


def merged_model(save: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for state in load(save).values():
        out.update(state["model"])
    return out


def assert_equal_nested(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"differs at {where}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"keys differ at {where}"
        for k in a:
            assert_equal_nested(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"lengths differ at {where}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"differs at {where}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
def pp_runs(tmp_path_factory):
    """Results of one configuration, computed once per session: ("single" | launcher+nproc, extra args)."""
    cache: dict[tuple, Path] = {}

    def get(kind: str, *extra: str) -> Path:
        key = (kind, extra)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"pp-{kind}") / "save"
            args = (*COMMON, *extra, "--save-dir", str(out))
            tag = f"pp-{uuid.uuid4().hex}"
            if kind == "single":
                cmd = [sys.executable, str(TRAIN_PP), *args]
            elif kind.startswith("torchrun"):
                cmd = torchrun(int(kind.removeprefix("torchrun")), *args)
            else:
                cmd = swiftrun_cmd("--nproc-per-node", kind.removeprefix("swiftrun"), "--no-dashboard", "--spares", "0",
                                   str(TRAIN_PP), *args)
            launch(cmd, tag)
            wait_until(lambda: not processes_with_marker(tag), timeout=10, what="the run's processes to exit")
            cache[key] = out
        return cache[key]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule,nproc", [("1f1b", 4), ("gpipe", 4), ("interleaved", 2)])
def test_schedule_equals_single_process(pp_runs, schedule, nproc):
    single = pp_runs("single")
    save = pp_runs(f"torchrun{nproc}", "--schedule", schedule)
    states = load(save)
    assert sorted(states) == [f"rank{r}.pt" for r in range(nproc)]
    stages = [states[f"rank{r}.pt"]["stage"] for r in range(nproc)]
    assert stages == ([[r, r + nproc] for r in range(nproc)] if schedule == "interleaved" else list(range(nproc)))
    assert all(s["step"] == STEPS for s in states.values())
    reference = torch.load(single / "rank0.pt", weights_only=True)["model"]
    assert_equal_nested(merged_model(save), reference, "model")


@pytest.mark.timeout(300)
@pytest.mark.extended
def test_two_by_two_data_parallel(pp_runs):
    save = pp_runs("torchrun4", "--dp", "2", "--schedule", "1f1b")
    states = load(save)
    assert [states[f"rank{r}.pt"]["stage"] for r in range(4)] == [0, 1, 0, 1]  # stage = rank % 2
    for stage in (0, 1):  # DDP on the stage's group keeps the replicas equal, although their batches differ
        assert_equal_nested(states[f"rank{stage}.pt"]["model"], states[f"rank{stage + 2}.pt"]["model"], "model")
    single = torch.load(pp_runs("single") / "rank0.pt", weights_only=True)["model"]
    assert any(not torch.equal(single[k], v) for k, v in merged_model(save).items())  # replica 1's data counted


@pytest.mark.timeout(300)
@pytest.mark.extended
def test_two_runs_are_bitwise_equal(pp_runs, tmp_path, marker):
    first = pp_runs("torchrun4", "--schedule", "1f1b")
    again = tmp_path / "save"
    launch(torchrun(4, *COMMON, "--schedule", "1f1b", "--save-dir", str(again)), marker)
    assert_equal_nested(load(first), load(again), "rank files")


@pytest.mark.timeout(300)
@pytest.mark.extended
def test_resume_from_checkpoint_equals_uninterrupted(pp_runs, tmp_path, marker):
    uninterrupted = pp_runs("torchrun4", "--schedule", "1f1b")
    ckpt, save = tmp_path / "ckpt", tmp_path / "save"
    stopped_at = STEPS // 2
    args = (*COMMON, "--schedule", "1f1b", "--ckpt-dir", str(ckpt), "--ckpt-every", str(stopped_at))
    launch(torchrun(4, *args, "--steps", str(stopped_at), "--save-dir", str(tmp_path / "first")), marker)  # the last --steps wins
    assert sorted(p.name for p in ckpt.iterdir()) == [f"stage{s}-replica0.pt" for s in range(4)]
    out = launch(torchrun(4, *args, "--save-dir", str(save)), marker)  # --steps STEPS: resumes, then goes on
    assert f"train_pp: resumed from step {stopped_at}" in out
    assert_equal_nested(load(uninterrupted), load(save), "rank files")


@pytest.mark.timeout(300)
def test_under_swiftrun_equals_torchrun(pp_runs):
    save = pp_runs("swiftrun4", "--schedule", "1f1b")
    assert_equal_nested(load(pp_runs("torchrun4", "--schedule", "1f1b")), load(save), "rank files")


@pytest.mark.timeout(300)
def test_swiftrun_replays_a_killed_interleaved_rank_to_torchruns_result(pp_runs, tmp_path, marker):
    """Interleaved 1F1B on 2 ranks (4 virtual stages), rank 1 SIGKILLed mid-run: its replacement replays both of
    its stages from the checkpoint rank 0 holds, and the job ends bitwise equal to plain torchrun's run."""
    reference = pp_runs("torchrun2", "--schedule", "interleaved")
    save = tmp_path / "save"
    events = tmp_path / "events.jsonl"
    launch(swiftrun_cmd("--nproc-per-node", "2", "--no-dashboard", "--event-log", str(events),
                        "--fault", "1:5:backward:sigkill", str(TRAIN_PP), *COMMON, "--schedule", "interleaved",
                        "--ckpt-every", "2", "--save-dir", str(save)), marker)
    assert '"event":"replay"' in events.read_text()
    assert_equal_nested(load(reference), load(save), "rank files")


@pytest.mark.timeout(300)
@pytest.mark.extended  # a 4-rank run; tests/unit/test_pp_parallel.py covers the side-effect check in the default suite
def test_swiftrun_replays_a_killed_stage_whose_dropout_counts_forwards(pp_runs, tmp_path, marker):
    """4 stages, 1F1B, rank 1 SIGKILLed: its replacement is offered the three idle survivors as helpers, but the
    script's dropout derives its mask from the number of forwards run in the step (a counter the module changes),
    which a helper starting at micro-batch k cannot know. The first forward's side effect is seen and the stage is
    replayed alone: bitwise torchrun's result (the fault campaign found a 2-5% different model before)."""
    reference = pp_runs("torchrun4", "--schedule", "1f1b")
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    launch(swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--spares", "0", "--event-log", str(events),
                        "--fault", "1:5:forward:sigkill", str(TRAIN_PP), *COMMON, "--schedule", "1f1b",
                        "--ckpt-every", "4", "--save-dir", str(save)), marker)
    replays = [json.loads(line) for line in events.read_text().splitlines() if '"event":"replay"' in line]
    assert replays and replays[0]["helpers"] == [0, 2, 3], replays
    assert_equal_nested(load(reference), load(save), "rank files")


@pytest.mark.extended  # a reference run of its own (8 layers); interleaved replay stays in the default suite
@pytest.mark.timeout(300)
def test_swiftrun_recovers_interleaved_4_ranks_from_a_kill_in_step_1(pp_runs, tmp_path, marker):
    """Interleaved 1F1B on 4 ranks (8 virtual stages), rank 3 SIGKILLed in step 1's forward. torch's runtime
    schedule keeps the receives it posted for a micro-batch until its forward or backward runs, across steps: the
    aborted step left some behind and a survivor failed the next step with "Recv twice ... without executing
    forward" (fault campaign, pp_interleaved run 0), so survivors were replaced one after the other. The recovery
    clears them: no survivor is replaced, and the model is bitwise the single process's."""
    single = pp_runs("single", "--layers", "8")
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    launch(swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--event-log", str(events),
                        "--fault", "3:1:forward:sigkill", str(TRAIN_PP), *COMMON, "--layers", "8",
                        "--schedule", "interleaved", "--ckpt-every", "2", "--save-dir", str(save)), marker)
    failed = [json.loads(line)["rank"] for line in events.read_text().splitlines() if '"worker_failed"' in line]
    assert failed == [3], failed
    reference = torch.load(single / "rank0.pt", weights_only=True)["model"]
    assert_equal_nested(merged_model(save), reference, "model")


@pytest.mark.extended  # tests/integration/test_pipeline.py covers the lockstep replay in the default suite
@pytest.mark.timeout(300)
def test_swiftrun_replays_every_replica_of_a_stage_lost_together(pp_runs, tmp_path, marker):
    """2 stages x 2 replicas (--dp 2), 1F1B, both replicas of the last stage (ranks 1 and 3) SIGKILLed together in
    step 4's backward: each replacement replays from its checkpoint in its own pipeline, the stage's DDP all-reduce live
    between them. Bitwise torchrun's failure-free run, replicas equal."""
    reference = pp_runs("torchrun4", "--dp", "2", "--schedule", "1f1b")
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    code, out, err = run_killing_together(  # both at the same instant (tests/helpers.py)
        swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--spares", "0", "--event-log", str(events),
                     "--fault", "1:4:backward:sigstop", "--fault", "3:4:backward:sigstop", str(TRAIN_PP),
                     *COMMON, "--dp", "2", "--schedule", "1f1b", "--ckpt-every", "3", "--save-dir", str(save)),
        marker, events, (1, 3))
    assert code == 0, (out + err)[-4000:]
    replays = [json.loads(line) for line in events.read_text().splitlines() if '"event":"replay"' in line]
    assert sorted(r["rank"] for r in replays) == [1, 3] and all(r["ranks"] == [1, 3] for r in replays), replays
    assert_equal_nested(load(reference), load(save), "rank files")


@pytest.mark.extended  # a long replay to interrupt, with a reference of its own
@pytest.mark.timeout(300)
def test_a_lockstep_replay_interrupted_by_a_replacements_death_is_replayed_again(pp_runs, tmp_path, marker):
    """Both replicas of stage 0 killed together at step 28 (checkpoints every 30: the replay runs steps 0..27), then the
    replacement of rank 2 SIGKILLed from outside as soon as the `replay` event shows: rank 0's replacement is
    blocked in the stage's all-reduce with it; the abort releases it and the next generation replays both again,
    bitwise torchrun's failure-free run."""
    args = ("--dp", "2", "--schedule", "1f1b", "--steps", "34")
    reference = pp_runs("torchrun4", *args)
    save, events = tmp_path / "save", tmp_path / "events.jsonl"

    def records() -> list[dict]:
        return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []

    def kill_rank_2s_replacement_once_replaying() -> None:
        wait_until(lambda: any(r["event"] == "replay" for r in records()), timeout=200, interval=0.005,
                   what="the lockstep replay")
        pid = [r["pid"] for r in records() if r["event"] == "worker_state" and r.get("rank") == 2 and r.get("pid")][-1]
        os.kill(pid, signal.SIGKILL)

    code, out, err = run_killing_together(
        swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--spares", "0", "--event-log", str(events),
                     "--fault", "0:28:forward:sigstop", "--fault", "2:28:forward:sigstop", str(TRAIN_PP),
                     *COMMON, *args, "--ckpt-every", "30", "--save-dir", str(save)),
        marker, events, (0, 2), then=kill_rank_2s_replacement_once_replaying)
    assert code == 0, (out + err)[-4000:]
    generations = sorted({r["generation"] for r in records() if r["event"] == "replay"})
    assert len(generations) == 2, f"the replay was not interrupted and run again: {generations}"
    assert all(r["ranks"] == [0, 2] for r in records() if r["event"] == "replay")
    assert_equal_nested(load(reference), load(save), "rank files")


@pytest.mark.extended  # 6 ranks and a reference of their own
@pytest.mark.timeout(300)
def test_three_replicas_of_a_stage_replay_with_the_bucket_layout_of_their_checkpoint(pp_runs, tmp_path, marker):
    """2 stages x 3 replicas, hidden 512 (DDP rebuilds each stage's gradients into two buckets after step 0), the
    three replicas of stage 0 SIGKILLed in step 5: they replay steps 3..4 in lockstep. A three-term all-reduce
    rounds differently with other buckets, so the replacements' fresh reducers must run the layout of the
    checkpoint's step (carried in the stage checkpoint): without it the run ended 1.4e-7 relative off (measured
    by disabling the rebind), with it bitwise torchrun's run."""
    args = ("--dp", "3", "--schedule", "1f1b", "--hidden", "512")
    reference = pp_runs("torchrun6", *args)
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    stops = [arg for r in (0, 2, 4) for arg in ("--fault", f"{r}:5:forward:sigstop")]
    code, out, err = run_killing_together(
        swiftrun_cmd("--nproc-per-node", "6", "--no-dashboard", "--spares", "0", "--event-log", str(events),
                     *stops, str(TRAIN_PP), *COMMON, *args, "--ckpt-every", "3", "--save-dir", str(save)),
        marker, events, (0, 2, 4))
    assert code == 0, (out + err)[-4000:]
    replays = [json.loads(line) for line in events.read_text().splitlines() if '"event":"replay"' in line]
    assert replays and all(r["ranks"] == [0, 2, 4] for r in replays), replays
    assert_equal_nested(load(reference), load(save), "rank files")


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pids(records: list[dict], ranks: tuple[int, ...]) -> dict[int, set[int]]:
    pids: dict[int, set[int]] = {}
    for r in records:
        if r["event"] == "worker_state" and r.get("rank") in ranks and r.get("pid"):
            pids.setdefault(r["rank"], set()).add(r["pid"])
    return pids


@pytest.mark.timeout(300)
def test_budget_0_on_an_interleaved_pipeline_replays_every_rank_from_its_own_checkpoint(pp_runs, tmp_path, marker):
    """Interleaved 1F1B on 2 ranks (4 virtual stages) with --log-budget 0: one logging group of both positions,
    nothing logged after the plan. Rank 1 SIGKILLed: its replacement and rank 0 (rolled back to its own checkpoint
    copy, same process) replay together, all their virtual stages talking live. Bitwise plain torchrun's run
    (model and optimizer state)."""
    reference = pp_runs("torchrun2", "--schedule", "interleaved")
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    launch(swiftrun_cmd("--nproc-per-node", "2", "--no-dashboard", "--event-log", str(events), "--log-budget", "0",
                        "--fault", "1:5:backward:sigkill", str(TRAIN_PP), *COMMON,
                        "--schedule", "interleaved", "--ckpt-every", "2", "--save-dir", str(save)), marker)
    records = _events(events)
    (plan,) = [r for r in records if r["event"] == "log_plan"]
    assert plan["groups"] == [[0, 1]] and plan["logged"] == [] and plan["peak_log_bytes"] == 0, plan
    assert "of ranks (interleaved: 4 stages on 2)" in plan["message"], plan
    assert {tuple(r["ranks"]) for r in records if r["event"] == "replay"} == {(0, 1)}
    assert [r["rank"] for r in records if r["event"] == "worker_failed"] == [1]
    assert len(_pids(records, (0,))[0]) == 1  # rank 0 replayed in its own process
    assert_equal_nested(load(reference), load(save), "rank files")


@pytest.mark.extended  # 4 ranks and a reference run of their own; the 2-rank test above stays in the default suite
@pytest.mark.timeout(300)
def test_selective_logging_of_an_interleaved_pipeline_replays_the_killed_ranks_group(pp_runs, tmp_path, marker):
    """Interleaved 1F1B on 4 ranks (8 virtual stages) under --log-budget: the plan groups pipeline positions (a
    rank's virtual stages fail together), logging only the virtual boundaries between groups. 16-wide activations,
    4 micro-batches: 2 KiB per virtual boundary and step, both ways; the edges 0-1, 1-2, 2-3 carry two boundaries
    each, the wrap (stage 3 -> 4) one. 14 KiB over 2 steps logs edge 1-2 and the wrap: groups [0,1] [2,3], 12 KiB
    ([1,2] [3,0] would cost 16). Rank 1 SIGKILLed: ranks 0 and 1 replay (rank 0 rolls back to its own copy; inside
    the group the traffic runs live, from ranks 2 and 3 it is served from their logs); ranks 2 and 3 keep their
    processes. The model ends bitwise the single process's (which interleaved torchrun matches bitwise, above)."""
    single = pp_runs("single", "--layers", "8")  # 8 virtual stages: one block each
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    launch(swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--event-log", str(events), "--log-budget",
                        "14KiB", "--fault", "1:5:backward:sigkill", str(TRAIN_PP), *COMMON,
                        "--schedule", "interleaved", "--layers", "8", "--ckpt-every", "2", "--save-dir", str(save)),
           marker)
    records = _events(events)
    (plan,) = [r for r in records if r["event"] == "log_plan"]
    assert plan["groups"] == [[0, 1], [2, 3]] and plan["virtual_stages"] == 8, plan
    assert plan["logged"] == [1, 3, 5] and plan["edges"] == [1, 3], plan  # 1->2, 3->4 (the wrap), 5->6
    assert plan["peak_log_bytes"] <= 14 * 1024 and len(plan["boundary_bytes"]) == 3 and plan["wrap_bytes"] > 0, plan
    assert "groups [0,1] [2,3] of ranks (interleaved: 8 stages on 4)" in plan["message"], plan
    assert {tuple(r["ranks"]) for r in records if r["event"] == "replay"} == {(0, 1)}
    assert [r["rank"] for r in records if r["event"] == "worker_failed"] == [1]
    pids = _pids(records, (0, 2, 3))
    assert sorted(pids) == [0, 2, 3] and all(len(p) == 1 for p in pids.values()), pids  # same processes
    reference = torch.load(single / "rank0.pt", weights_only=True)["model"]
    assert_equal_nested(merged_model(save), reference, "model")


@pytest.mark.extended  # 4 ranks, two runs and a reference of their own
@pytest.mark.timeout(400)
@pytest.mark.parametrize("budget, replaying", [("0", (0, 1, 2, 3)), ("1GiB", (1, 3))])
def test_every_replica_of_an_interleaved_position_lost_under_a_log_budget(pp_runs, tmp_path, marker, budget,
                                                                          replaying):
    """Interleaved 1F1B, 2 positions x 2 replicas (4 virtual stages per pipeline), --log-budget; both replicas of
    position 1 (ranks 1 and 3) SIGKILLed together in step 5's backward. Budget 0: one logging group per replica,
    so all four ranks replay in lockstep (ranks 0 and 2 from their own copies, in their own processes), the stages'
    DDP all-reduces live. A budget that logs everything: ranks 1 and 3 replay, ranks 0 and 2 keep their state.
    Both bitwise plain torchrun's failure-free run."""
    args = ("--dp", "2", "--schedule", "interleaved")
    reference = pp_runs("torchrun4", *args)
    save, events = tmp_path / "save", tmp_path / "events.jsonl"
    code, out, err = run_killing_together(
        swiftrun_cmd("--nproc-per-node", "4", "--no-dashboard", "--spares", "0", "--event-log", str(events),
                     "--log-budget", budget, "--fault", "1:5:backward:sigstop", "--fault", "3:5:backward:sigstop",
                     str(TRAIN_PP), *COMMON, *args, "--ckpt-every", "2", "--save-dir", str(save)),
        marker, events, (1, 3))
    assert code == 0, (out + err)[-4000:]
    records = _events(events)
    (plan,) = [r for r in records if r["event"] == "log_plan"]
    assert plan["groups"] == ([[0, 1]] if budget == "0" else [[0], [1]]), plan
    assert {tuple(r["ranks"]) for r in records if r["event"] == "replay"} == {replaying}
    pids = _pids(records, (0, 2))
    assert all(len(pids[r]) == 1 for r in (0, 2)), pids  # the survivors kept their processes
    assert_equal_nested(load(reference), load(save), "rank files")
