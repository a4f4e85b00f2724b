"""Launch configuration (swiftrun.config): timeout ordering, flag validation, fault specs."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swiftrun.config import (
    Entrypoint,
    EntrypointKind,
    FaultSpec,
    LaunchConfig,
    RecoveryMode,
    Std,
    Timeouts,
)
from swiftrun.errors import ConfigError

SCRIPT = Entrypoint(EntrypointKind.SCRIPT, "train.py")


def config(**kw) -> LaunchConfig:
    return LaunchConfig(entrypoint=SCRIPT, **kw)


# --- Timeouts --------------------------------------------------------------------------------------------------


def test_default_timeouts_are_valid_and_progress_detection_is_off():
    t = Timeouts()
    assert t.heartbeat_interval * 2 <= t.heartbeat_timeout
    assert t.progress_timeout == 0


@pytest.mark.parametrize(
    "name", ["heartbeat_interval", "heartbeat_timeout", "shutdown_timeout", "recovery_timeout", "startup_timeout"]
)
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_timeout_that_is_not_positive_is_refused_by_its_flag_name(name, value):
    fields = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0, name: value}
    with pytest.raises(ConfigError, match=name.replace("_", "-")):
        Timeouts(**fields)


def test_a_negative_progress_timeout_is_refused():
    with pytest.raises(ConfigError, match="progress-timeout"):
        Timeouts(progress_timeout=-1)


def test_heartbeat_timeout_must_be_at_least_twice_the_interval():
    assert Timeouts(heartbeat_interval=1.0, heartbeat_timeout=2.0).heartbeat_timeout == 2.0  # the boundary holds
    with pytest.raises(ConfigError, match="heartbeat-timeout"):
        Timeouts(heartbeat_interval=1.0, heartbeat_timeout=1.99)


def test_progress_timeout_must_not_be_shorter_than_heartbeat_timeout():
    assert Timeouts(heartbeat_timeout=5, progress_timeout=5).progress_timeout == 5
    with pytest.raises(ConfigError, match="progress-timeout"):
        Timeouts(heartbeat_timeout=5, progress_timeout=4.9)


def test_timeouts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Timeouts().heartbeat_timeout = 1  # type: ignore[misc]


# --- LaunchConfig ----------------------------------------------------------------------------------------------


def test_defaults_describe_a_one_process_swift_job():
    c = config()
    assert (c.world_size, c.swift, c.recovery, c.max_restarts, c.spares) == (1, True, RecoveryMode.AUTO, 0, 1)


@pytest.mark.parametrize(("nproc", "nnodes", "world"), [(1, (1, 1), 1), (4, (1, 1), 4), (4, (2, 2), 8), (2, (3, 5), 6)])
def test_world_size_is_min_nodes_times_processes_per_node(nproc, nnodes, world):
    assert config(nproc_per_node=nproc, nnodes=nnodes).world_size == world


@pytest.mark.parametrize("mode", list(RecoveryMode))
def test_only_restart_mode_is_not_swift(mode):
    assert config(recovery=mode).swift is (mode is not RecoveryMode.RESTART)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node"),
        ({"nnodes": (0, 1)}, "--nnodes"),
        ({"nnodes": (3, 2)}, "--nnodes"),
        ({"master_port": 65536}, "--master-port"),
        ({"master_port": -1}, "--master-port"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"max_recoveries": -1}, "--max-recoveries"),
        ({"spares": -1}, "--spares"),
        ({"startup_restarts": -1}, "--startup-restarts"),
        ({"verify_every": -1}, "--verify-every"),
        ({"transfer_chunk_mb": -2}, "--transfer-chunk-mb"),
        ({"monitor_interval": 0}, "--monitor-interval"),
        ({"nproc_per_node": 2, "redirects": (Std.ALL,)}, "--redirects"),
        ({"nproc_per_node": 2, "tee": (Std.OUT, Std.ERR, Std.NONE)}, "--tee"),
        ({"nproc_per_node": 2, "local_ranks_filter": frozenset({0, 2})}, "--local-ranks-filter"),
        ({"nproc_per_node": 2, "local_ranks_filter": frozenset({-1})}, "--local-ranks-filter"),
    ],
)
def test_invalid_launch_config_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        config(**kwargs)


def test_boundary_values_are_accepted():
    c = config(nproc_per_node=2, nnodes=(1, 3), master_port=0, max_restarts=0, max_recoveries=0, spares=0,
               startup_restarts=0,
               redirects=(Std.OUT, Std.ALL), tee=(Std.NONE, Std.ERR), local_ranks_filter=frozenset({0, 1}))
    assert c.master_port == 0 and c.std_redirect(1) is Std.ALL and c.std_tee(1) is Std.ERR
    assert config(master_port=65535).master_port == 65535


def test_a_fault_for_a_rank_outside_the_world_is_refused():
    fault = FaultSpec(4, 1, "step", "sigkill")
    with pytest.raises(ConfigError, match="rank 4 of a world of 4"):
        config(nproc_per_node=2, nnodes=(2, 2), faults=(fault,))
    assert config(nproc_per_node=2, nnodes=(3, 3), faults=(fault,)).faults == (fault,)


def test_per_rank_streams_default_to_none_and_every_rank_shows_without_a_filter():
    c = config(nproc_per_node=3)
    assert [c.std_redirect(r) for r in range(3)] == [Std.NONE] * 3
    assert [c.std_tee(r) for r in range(3)] == [Std.NONE] * 3
    assert all(c.shows_on_console(r) for r in range(3))
    filtered = config(nproc_per_node=3, local_ranks_filter=frozenset({1}))
    assert [filtered.shows_on_console(r) for r in range(3)] == [False, True, False]


def test_config_errors_are_usage_errors():
    with pytest.raises(ConfigError) as info:
        config(nproc_per_node=0)
    assert info.value.exit_code == 2


# --- FaultSpec -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("1:5:step:sigkill", FaultSpec(1, 5, "step", "sigkill")),
        ("0:0:forward:exception", FaultSpec(0, 0, "forward", "exception")),
        ("3:12:allreduce:sigstop:every", FaultSpec(3, 12, "allreduce", "sigstop", every_incarnation=True)),
        ("  2:7:after-step:exit\n", FaultSpec(2, 7, "after-step", "exit")),
    ],
)
def test_fault_spec_parses_rank_step_phase_kind_and_every(text, spec):
    assert FaultSpec.parse(text) == spec


@given(
    rank=st.integers(0, 1000),
    step=st.integers(0, 10**6),
    phase=st.sampled_from(FaultSpec.PHASES),
    kind=st.sampled_from(FaultSpec.KINDS),
    every=st.booleans(),
)
def test_fault_spec_encode_parse_round_trip(rank, step, phase, kind, every):
    spec = FaultSpec(rank, step, phase, kind, every)
    assert FaultSpec.parse(spec.encode()) == spec


def test_fault_spec_encodes_every_as_a_fifth_field():
    assert FaultSpec(1, 2, "recover", "segfault", True).encode() == "1:2:recover:segfault:every"
    assert FaultSpec(1, 2, "recover", "segfault").encode() == "1:2:recover:segfault"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:5:step", "RANK:STEP:PHASE:KIND"),
        ("1:5:step:sigkill:every:more", "RANK:STEP:PHASE:KIND"),
        ("1:5:step:sigkill:always", "RANK:STEP:PHASE:KIND"),
        ("", "RANK:STEP:PHASE:KIND"),
        ("one:5:step:sigkill", "integers"),
        ("1:5.5:step:sigkill", "integers"),
        ("1:5:lunch:sigkill", "fault phase 'lunch'"),
        ("1:5:step:sigint", "fault kind 'sigint'"),
        ("-1:5:step:sigkill", ">= 0"),
        ("1:-5:step:sigkill", ">= 0"),
    ],
)
def test_bad_fault_specs_are_refused_with_a_message(text, message):
    with pytest.raises(ConfigError, match=message):
        FaultSpec.parse(text)
