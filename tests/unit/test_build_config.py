"""Flag resolution as a pure function: :func:`swiftrun.cli.resolve.build_config`, driven without typer.

``test_cli.py`` drives the whole command line through typer; these tests give ``build_config`` a ``Flags`` and an
explicit environment and look at the config, so every rule between flags (Slurm's defaults, the coordinator,
rendezvous, ``--rdzv-conf`` keys) is checked without a parser and without the process's own environment.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from swiftrun.cli.resolve import Flags, build_config
from swiftrun.config import EntrypointKind, ExactUndo, RecoveryMode
from swiftrun.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[07-10]",
}


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def build(flags: Flags, environ: dict[str, str] | None = None, **kwargs):
    return build_config(flags, environ or {}, new_id=lambda: "fresh-id", cuda_count=lambda: 0, **kwargs)


def test_the_defaults_are_torchruns_single_node_launch(script: str) -> None:
    config = build(Flags(script))
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (1, (1, 1), 0)
    assert config.entrypoint.kind is EntrypointKind.SCRIPT and config.entrypoint.args == ()
    # static with no port: a free port and a fresh id, as torchrun does for one node
    assert (config.rdzv_backend, config.master_port, config.rdzv_id) == ("c10d", 0, "fresh-id")
    assert config.recovery is RecoveryMode.AUTO and config.spares == 1 and config.max_recoveries == 16
    assert config.timeouts.shutdown_timeout == 30.0 and config.timeouts.join_timeout == 120.0
    assert config.redirects == () and config.tee == () and config.faults == ()


def test_the_environment_read_is_the_one_passed_in(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "99")
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    config = build(Flags(script), {})
    assert config.timeouts.shutdown_timeout == 30.0 and config.nnodes == (1, 1)
    assert build(Flags(script), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}).timeouts.shutdown_timeout == 5.0
    flag_wins = build(Flags(script, shutdown_timeout=7.0), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})
    assert flag_wins.timeouts.shutdown_timeout == 7.0
    with pytest.raises(ConfigError, match="TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        build(Flags(script), {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"})


def test_slurm_fills_only_what_no_flag_gave(script: str) -> None:
    config = build(Flags(script), SLURM)
    assert (config.nnodes, config.node_rank, config.rdzv_id) == ((4, 4), 2, "4242")
    assert (config.rdzv_backend, config.master_addr, config.master_port) == ("c10d", "gpu07", 29400)
    given = build(Flags(script, nnodes="2", node_rank=1, rdzv_id="mine", master_port=29555), SLURM)
    assert (given.nnodes, given.node_rank, given.rdzv_id) == ((2, 2), 1, "mine")
    assert (given.rdzv_backend, given.master_port) == ("static", 29555)  # a port given: no c10d endpoint
    spares = build(Flags(script, spare_nodes=1), SLURM)
    assert spares.nnodes == (3, 3)
    assert build(Flags(script), {**SLURM, "SWIFTRUN_SLURM": "0"}).nnodes == (1, 1)


def test_the_coordinator_is_node_zero_of_an_external_store_and_needs_no_script(tmp_path: Path) -> None:
    absent = str(tmp_path / "elsewhere.py")
    flags = Flags(absent, nnodes="2", node_rank=1, rdzv_backend="c10d", rdzv_endpoint="head:29400")
    config = build(flags, coordinator=True)
    assert (config.node_rank, config.external_coordinator) == (0, True)
    with pytest.raises(ConfigError, match="not found"):
        build(flags)
    with pytest.raises(ConfigError, match="not --standalone"):
        build(replace(flags, standalone=True), coordinator=True)


def test_several_nodes_on_the_static_backend_need_one_store(script: str) -> None:
    with pytest.raises(ConfigError, match="--master-port"):
        build(Flags(script, nnodes="2"))
    config = build(Flags(script, nnodes="2", master_addr="head", master_port=29511))
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "head:29511")


def test_rdzv_conf_keys_become_timeouts_and_the_control_port(script: str) -> None:
    config = build(Flags(script, rdzv_conf="join_timeout=30,connect_timeout=4,control_port=29401"))
    assert (config.timeouts.join_timeout, config.timeouts.connect_timeout, config.control_port) == (30, 4, 29401)
    with pytest.raises(ConfigError, match="join_timeout"):
        build(Flags(script, rdzv_conf="join_timeout=later"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"recovery": "sometimes"}, "--recovery"),
        ({"start_method": "teleport"}, "--start-method"),
        ({"node_rank": -1}, "--node-rank"),
        ({"log_budget": "lots"}, "--log-budget"),
        ({"numa_binding": "node"}, "--numa-binding"),
        ({"nproc_per_node": "gpu"}, "CUDA is not available"),
        ({"module": True, "no_python": True}, "--no-python"),
    ],
)
def test_bad_values_are_config_errors_naming_the_flag(script: str, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(replace(Flags(script), **change))


def test_values_are_parsed_into_the_config(script: str) -> None:
    flags = Flags(
        script, script_args=("--lr", "0.1"), nproc_per_node="3", tee="1:3", log_budget="2KiB",
        fault=("1:4:step:sigkill",), recovery="undo", exact_undo=True, dashboard=False,
    )
    config = build(flags)
    assert config.entrypoint.args == ("--lr", "0.1") and config.nproc_per_node == 3
    assert [int(std) for std in config.tee] == [0, 3, 0]
    assert config.log_budget == 2048 and config.recovery is RecoveryMode.UNDO and config.exact_undo is ExactUndo.ON
    assert [(f.rank, f.step) for f in config.faults] == [(1, 4)] and config.dashboard is False


def test_every_typer_flag_is_a_field_with_the_same_default() -> None:
    from swiftrun.cli import command

    params = inspect.signature(command.launch).parameters
    declared = {name for name in params if name != "ctx"}
    assert declared == set(Flags.names())
    for name, param in params.items():
        if name in ("ctx", "script", "script_args", "fault"):
            continue
        assert param.default == getattr(Flags, name), name


def test_resolution_imports_neither_typer_nor_torch() -> None:
    code = (
        "import sys; import swiftrun.cli.resolve, swiftrun.cli.parse; "
        "bad = [m for m in ('typer', 'click', 'torch', 'rich') if m in sys.modules]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert result.returncode == 0, f"imported: {result.stdout.strip()} {result.stderr[-500:]}"


@pytest.mark.parametrize(("given", "expected"), [(None, ExactUndo.AUTO), (True, ExactUndo.ON), (False, ExactUndo.OFF)])
def test_exact_undo_is_automatic_unless_said(script: str, given, expected) -> None:
    assert build(Flags(script, exact_undo=given)).exact_undo is expected
