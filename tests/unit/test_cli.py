"""The swiftrun CLI: torchrun's flags, spellings and env vars in, one LaunchConfig out."""

from __future__ import annotations

import os
import signal
import sys
import time
import types
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

import swiftrun.launcher
from swiftrun import cli
from swiftrun.cli import parse as cli_parse
from swiftrun.config import EntrypointKind, FaultSpec, LaunchConfig, RecoveryMode, Std
from swiftrun.errors import ConfigError, LaunchError

REFUSED = [
    ["--logs-specs", "mine"],
    ["--numa-binding", "node"],
    ["--event-log-handler", "console"],
    ["--duplicate-stdout-filters", "loss"],
    ["--duplicate-stderr-filters", "error"],
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No PET_/SWIFTRUN_ variable of the developer's shell leaks in; train.py exists in the cwd."""
    for name in list(os.environ):
        if name.startswith(("PET_", "SWIFTRUN_", "SLURM_")) or name == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    """Every config handed to swiftrun.launcher.launch, which returns 0 without launching anything."""
    configs: list[LaunchConfig] = []

    def fake_launch(config: LaunchConfig) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(swiftrun.launcher, "launch", fake_launch, raising=False)
    return configs


def invoke(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(cli.app, args, env=env)


def config_of(launched: list[LaunchConfig], args: list[str], env: dict[str, str] | None = None) -> LaunchConfig:
    result = invoke(args, env)
    assert result.exit_code == 0, result.output
    return launched.pop()


def underscored(args: list[str]) -> list[str]:
    return [a.replace("-", "_").replace("__", "--", 1) if a.startswith("--") else a for a in args]


# --- spellings, env vars, precedence -------------------------------------------------------------------------

FLAG_CASES = [
    (["--nproc-per-node", "4"], "PET_NPROC_PER_NODE", "4"),
    (["--master-port", "29501"], "PET_MASTER_PORT", "29501"),
    (["--master-addr", "10.0.0.1"], "PET_MASTER_ADDR", "10.0.0.1"),
    (["--max-restarts", "3"], "PET_MAX_RESTARTS", "3"),
    (["--monitor-interval", "0.5"], "PET_MONITOR_INTERVAL", "0.5"),
    (["--rdzv-backend", "c10d"], "PET_RDZV_BACKEND", "c10d"),
    (["--rdzv-endpoint", "node0:1234"], "PET_RDZV_ENDPOINT", "node0:1234"),
    (["--rdzv-id", "job7"], "PET_RDZV_ID", "job7"),
    (["--rdzv-conf", "timeout=60,read_timeout=5"], "PET_RDZV_CONF", "timeout=60,read_timeout=5"),
    (["--role", "trainer"], "PET_ROLE", "trainer"),
    (["--log-dir", "/tmp/logs"], "PET_LOG_DIR", "/tmp/logs"),
    (["--redirects", "3"], "PET_REDIRECTS", "3"),
    (["--tee", "0:1"], "PET_TEE", "0:1"),
    (["--local-ranks-filter", "0"], "PET_LOCAL_RANKS_FILTER", "0"),
    (["--local-addr", "10.0.0.2"], "PET_LOCAL_ADDR", "10.0.0.2"),
    (["--signals-to-handle", "SIGTERM,SIGUSR1"], "PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1"),
    (["--shutdown-timeout", "5"], "PET_SHUTDOWN_TIMEOUT", "5"),
    (["--start-method", "fork"], "PET_START_METHOD", "fork"),
    (["--nnodes", "1"], "PET_NNODES", "1"),
    (["--node-rank", "0"], "PET_NODE_RANK", "0"),
    (["--standalone"], "PET_STANDALONE", "1"),
    (["--virtual-local-rank"], "PET_VIRTUAL_LOCAL_RANK", "1"),
    (["--run-path"], "PET_RUN_PATH", "1"),
    (["--heartbeat-timeout", "60"], "SWIFTRUN_HEARTBEAT_TIMEOUT", "60"),
    (["--heartbeat-interval", "1"], "SWIFTRUN_HEARTBEAT_INTERVAL", "1"),
    (["--progress-timeout", "300"], "SWIFTRUN_PROGRESS_TIMEOUT", "300"),
    (["--recovery-timeout", "30"], "SWIFTRUN_RECOVERY_TIMEOUT", "30"),
    (["--recovery", "undo"], "SWIFTRUN_RECOVERY", "undo"),
    (["--max-recoveries", "2"], "SWIFTRUN_MAX_RECOVERIES", "2"),
    (["--spares", "0"], "SWIFTRUN_SPARES", "0"),
    (["--startup-restarts", "0"], "SWIFTRUN_STARTUP_RESTARTS", "0"),
    (["--verify-every", "50"], "SWIFTRUN_VERIFY_EVERY", "50"),
    (["--transfer-chunk-mb", "4"], "SWIFTRUN_TRANSFER_CHUNK_MB", "4"),
    (["--exact-undo"], "SWIFTRUN_EXACT_UNDO", "1"),
    (["--no-exact-undo"], "SWIFTRUN_EXACT_UNDO", "0"),
    (["--no-dashboard"], "SWIFTRUN_DASHBOARD", "0"),
    (["--event-log", "ev.jsonl"], "SWIFTRUN_EVENT_LOG", "ev.jsonl"),
    (["--fault", "0:3:step:sigkill"], "SWIFTRUN_FAULT", "0:3:step:sigkill"),
    (["--python", "/usr/bin/python3"], "SWIFTRUN_PYTHON", "/usr/bin/python3"),
]


@pytest.mark.parametrize(("flag", "env_name", "env_value"), FLAG_CASES, ids=[c[0][0] for c in FLAG_CASES])
def test_dashed_underscored_equals_and_env_spellings_agree(launched, monkeypatch, flag, env_name, env_value) -> None:
    monkeypatch.setattr(uuid, "uuid4", lambda: "fixed-id")  # the free-port rendezvous draws a random id
    dashed = config_of(launched, [*flag, "train.py"])
    assert dashed != config_of(launched, ["train.py"]) or flag[0] in ("--nnodes", "--node-rank", "--start-method")
    assert config_of(launched, [*underscored(flag), "train.py"]) == dashed
    if len(flag) == 2:
        assert config_of(launched, [f"{flag[0]}={flag[1]}", "train.py"]) == dashed
        assert config_of(launched, [f"{underscored(flag)[0]}={flag[1]}", "train.py"]) == dashed
    assert config_of(launched, ["train.py"], env={env_name: env_value}) == dashed


def test_short_flags_and_their_env(launched) -> None:
    assert config_of(launched, ["-m", "pkg.train"]).entrypoint.kind is EntrypointKind.MODULE
    assert config_of(launched, ["pkg.train"], env={"PET_MODULE": "1"}).entrypoint.kind is EntrypointKind.MODULE
    assert config_of(launched, ["--nproc-per-node", "2", "-r", "3", "train.py"]).redirects == (Std.ALL, Std.ALL)
    assert config_of(launched, ["--nproc-per-node", "2", "-t", "1:2", "train.py"]).tee == (Std.NONE, Std.ERR)


def test_unique_prefix_of_a_long_flag_is_accepted_like_argparse(launched) -> None:
    assert config_of(launched, ["--nproc", "3", "train.py"]).nproc_per_node == 3
    assert config_of(launched, ["--nproc_per", "3", "train.py"]).nproc_per_node == 3
    ambiguous = invoke(["--max", "3", "train.py"])  # --max-restarts or --max-recoveries
    assert ambiguous.exit_code == 2


def test_command_line_beats_env(launched) -> None:
    env = {"PET_NPROC_PER_NODE": "8", "PET_MAX_RESTARTS": "5", "SWIFTRUN_SPARES": "4", "PET_STANDALONE": "0"}
    args = ["--nproc-per-node", "2", "--max_restarts", "1", "--spares", "0", "--standalone", "train.py"]
    config = config_of(launched, args, env)
    assert (config.nproc_per_node, config.max_restarts, config.spares, config.standalone) == (2, 1, 0, True)
    assert config_of(launched, ["--no-dashboard", "train.py"], {"SWIFTRUN_DASHBOARD": "1"}).dashboard is False


def test_env_flag_zero_is_off(launched) -> None:
    config = config_of(launched, ["train.py"], {"PET_STANDALONE": "0", "PET_VIRTUAL_LOCAL_RANK": "0"})
    assert not config.standalone and not config.virtual_local_rank


def test_defaults_are_torchruns(launched) -> None:
    config = config_of(launched, ["train.py"])
    assert config.entrypoint.kind is EntrypointKind.SCRIPT and config.entrypoint.target == "train.py"
    assert config.entrypoint.args == () and not config.entrypoint.run_path
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (1, (1, 1), 0)
    assert (config.max_restarts, config.monitor_interval, config.role) == (0, 0.1, "default")
    assert config.signals_to_handle == (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    assert config.redirects == () and config.tee == () and config.local_ranks_filter is None
    assert config.timeouts.shutdown_timeout == 30.0 and config.log_dir is None and config.local_addr is None
    assert (config.recovery, config.max_recoveries, config.spares, config.dashboard) == (RecoveryMode.AUTO, 16, 1, None)
    assert config.startup_restarts == 3
    assert config.faults == () and config.python == "" and config.event_log is None


# --- script arguments ----------------------------------------------------------------------------------------


def test_script_args_are_untouched(launched) -> None:
    script_args = ["--nproc-per-node", "8", "-m", "--standalone", "--", "-h", "--help", "--lr=3e-4"]
    script_args += ["report", "--nproc_per_node=2", "--fault", "x"]
    config = config_of(launched, ["--nproc-per-node", "2", "train.py", *script_args])
    assert config.nproc_per_node == 2 and not config.standalone
    assert config.entrypoint.kind is EntrypointKind.SCRIPT
    assert config.entrypoint.args == tuple(script_args)


def test_double_dash_before_the_script(launched) -> None:
    config = config_of(launched, ["--nproc-per-node", "2", "--", "train.py", "-x"])
    assert config.entrypoint.target == "train.py" and config.entrypoint.args == ("-x",)


def test_module_and_executable_targets_are_not_checked(launched) -> None:
    module = config_of(launched, ["-m", "no.such.module", "--flag"]).entrypoint
    assert (module.kind, module.target, module.args) == (EntrypointKind.MODULE, "no.such.module", ("--flag",))
    program = config_of(launched, ["--no-python", "no-such-program"]).entrypoint
    assert (program.kind, program.target) == (EntrypointKind.EXECUTABLE, "no-such-program")


def test_run_path_wins_over_no_python(launched) -> None:
    entrypoint = config_of(launched, ["--run-path", "--no-python", "train.py"]).entrypoint
    assert (entrypoint.kind, entrypoint.run_path) == (EntrypointKind.SCRIPT, True)


def test_missing_script_exits_2_quickly(launched) -> None:
    start = time.monotonic()
    result = invoke(["--nproc-per-node", "4", "missing.py", "--lr", "3"])
    assert result.exit_code == 2
    assert "swiftrun: error: training script 'missing.py' not found" in result.stderr
    assert "Traceback" not in result.output
    assert time.monotonic() - start < 2.0
    assert launched == []


def test_no_script_at_all_is_a_usage_error(launched) -> None:
    assert invoke([]).exit_code == 2
    assert invoke(["--nproc-per-node", "2"]).exit_code == 2


# --- refused and malformed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", REFUSED, ids=[f[0] for f in REFUSED])
def test_unimplemented_torchrun_flags_are_refused_by_name(launched, flag) -> None:
    for spelling in (flag, underscored(flag)):
        result = invoke([*spelling, "train.py"])
        assert result.exit_code == 2, result.output
        assert "swiftrun: error:" in result.stderr and flag[0] in result.stderr
    assert launched == []


def test_refused_flags_also_from_env(launched) -> None:
    result = invoke(["train.py"], env={"PET_EVENT_LOG_HANDLER": "console"})
    assert result.exit_code == 2 and "--event-log-handler" in result.stderr
    result = invoke(["train.py"], env={"PET_DUPLICATE_STDOUT_FILTERS": "loss"})
    assert result.exit_code == 2 and "--duplicate-stdout-filters" in result.stderr


def test_event_log_handler_null_is_accepted(launched) -> None:
    config_of(launched, ["--event-log-handler", "null", "train.py"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "2"], "several nodes with the static backend need --master-addr and --master-port"),
        (["--nnodes", "2", "--standalone"], "--standalone runs one node"),
        (["--nnodes", "1:2", "--node-rank", "2", "--master-port", "5"], "--node-rank 2 is outside --nnodes 1:2"),
        (["--node-rank", "-1"], "--node-rank must be >= 0"),
        (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=x"], "join_timeout='x'"),
        (["--nnodes", "2", "--master-port", "5", "--node-lease", "20"], "must be shorter than node-timeout"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd is not supported"),
        (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2 is not supported"),
        (["--rdzv-backend", "zookeeper"], "--rdzv-backend 'zookeeper' is unknown"),
        (["--nproc-per-node", "x"], "--nproc-per-node 'x' is not an integer"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
        (["--nnodes", "2:1"], "--nnodes '2:1' must satisfy 0 < MIN <= MAX"),
        (["--nnodes", "a"], "--nnodes 'a' is not N or MIN:MAX"),
        (["--nnodes", "1:2:3"], "--nnodes '1:2:3' is not N or MIN:MAX"),
        (["-r", "7"], "--redirects '7' is not 0-3"),
        (["-t", "0:9"], "--tee '0:9' is not 0-3"),
        (["-t", "x:1"], "--tee 'x:1' is not 0-3"),
        (["--signals-to-handle", "SIGTERM,SIGFOO"], "unknown signal 'SIGFOO'"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be caught"),
        (["--rdzv-conf", "timeout"], "--rdzv-conf 'timeout' is not KEY=VALUE"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:99999"], "the port must be an integer"),
        (["--rdzv-endpoint", "node0"], "needs a port with the static backend"),
        (["--local-ranks-filter", "0,a"], "--local-ranks-filter '0,a'"),
        (["--local-ranks-filter", "3"], "outside 0..0"),
        (["--start-method", "thread"], "--start-method 'thread' is not one of spawn, fork, forkserver"),
        (["--recovery", "pray"], "--recovery 'pray' is not one of auto, roll-forward, undo, restart"),
        (["--fault", "0:3:step"], "is not RANK:STEP:PHASE:KIND[:every]"),
        (["--fault", "5:3:step:sigkill"], "names rank 5 of a world of 1"),
        (["--heartbeat-interval", "20"], "at least twice the heartbeat interval"),
        (["-m", "--no-python", "pkg"], "--no-python and -m/--module cannot be used together"),
    ],
)
def test_malformed_values_exit_2_with_a_clear_message(launched, args, message) -> None:
    result = invoke([*args, "train.py"] if args[-1] != "pkg" else args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("swiftrun: error: ")
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert launched == []


@pytest.mark.parametrize("args", [["--master-port", "x"], ["--bogus"], ["--max-restarts", "1.5"]])
def test_parser_errors_exit_2(launched, args) -> None:
    result = invoke([*args, "train.py"])
    assert result.exit_code == 2
    assert launched == []


def test_malformed_env_value_exits_2(launched) -> None:
    result = invoke(["train.py"], env={"PET_NPROC_PER_NODE": "many"})
    assert result.exit_code == 2 and "--nproc-per-node 'many'" in result.stderr


# --- rendezvous ----------------------------------------------------------------------------------------------


def test_standalone_is_c10d_on_a_free_port_with_a_random_id(launched) -> None:
    args = ["--standalone", "--rdzv-backend", "etcd", "--rdzv-endpoint", "x:1", "--rdzv-id", "mine", "train.py"]
    first, second = config_of(launched, args), config_of(launched, args)
    assert first.standalone
    assert (first.rdzv_backend, first.rdzv_endpoint, first.master_port) == ("c10d", "localhost:0", 0)
    assert first.master_addr == "127.0.0.1"
    assert first.rdzv_id not in ("mine", "none") and first.rdzv_id != second.rdzv_id


def test_single_node_without_master_port_picks_a_free_port(launched) -> None:
    config = config_of(launched, ["train.py"])
    assert not config.standalone
    assert (config.rdzv_backend, config.rdzv_endpoint, config.master_port) == ("c10d", "localhost:0", 0)
    assert config.rdzv_id != "none"
    assert config_of(launched, ["--rdzv-id", "job7", "train.py"]).rdzv_id == "job7"


def test_static_with_master_port(launched) -> None:
    config = config_of(launched, ["--master-addr", "10.1.2.3", "--master-port", "29500", "train.py"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", "10.1.2.3:29500")
    assert (config.master_addr, config.master_port, config.rdzv_id) == ("10.1.2.3", 29500, "none")


def test_static_endpoint_is_the_master(launched) -> None:
    config = config_of(launched, ["--rdzv-endpoint", "node0:4000", "--master-port", "1", "train.py"])
    assert (config.rdzv_backend, config.master_addr, config.master_port) == ("static", "node0", 4000)


def test_c10d_endpoint_sets_master_addr_and_port(launched) -> None:
    config = config_of(launched, ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:1234", "train.py"])
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "node0:1234")
    assert (config.master_addr, config.master_port) == ("node0", 1234)
    config = config_of(launched, ["--rdzv-backend", "c10d", "--rdzv-endpoint", "node0", "train.py"])
    assert (config.master_addr, config.master_port) == ("node0", 29400)
    config = config_of(launched, ["--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:5000", "train.py"])
    assert (config.master_addr, config.master_port) == ("::1", 5000)
    config = config_of(launched, ["--rdzv-backend", "c10d", "train.py"])
    assert (config.rdzv_endpoint, config.master_port) == ("localhost:29400", 29400)


def test_rdzv_conf_is_parsed(launched) -> None:
    config = config_of(launched, ["--rdzv-conf", "timeout=60, join_timeout = 5", "train.py"])
    assert config.rdzv_conf == (("timeout", "60"), ("join_timeout", "5"))


# --- other values --------------------------------------------------------------------------------------------


def test_swiftrun_flags_build_the_config(launched, tmp_path) -> None:
    args = [
        "--nproc-per-node", "2", "--heartbeat-interval", "1", "--heartbeat-timeout", "10", "--progress-timeout", "20",
        "--recovery-timeout", "40", "--startup-timeout", "50", "--recovery", "roll-forward", "--max-recoveries", "3",
        "--spares", "2", "--dashboard", "--event-log", "ev.jsonl", "--fault", "0:3:step:sigkill",
        "--fault", "1:5:allreduce:exception:every", "--python", "/opt/py", "--startup-restarts", "5", "train.py",
    ]  # fmt: skip
    config = config_of(launched, args)
    t = config.timeouts
    assert (t.heartbeat_interval, t.heartbeat_timeout, t.progress_timeout) == (1, 10, 20)
    assert (t.recovery_timeout, t.startup_timeout) == (40, 50)
    assert (config.recovery, config.max_recoveries, config.spares) == (RecoveryMode.ROLL_FORWARD, 3, 2)
    assert config.startup_restarts == 5
    assert config.dashboard is True
    assert config.event_log == Path("ev.jsonl") and config.python == "/opt/py"
    assert config.faults == (FaultSpec(0, 3, "step", "sigkill"), FaultSpec(1, 5, "allreduce", "exception", True))


def test_torchrun_values_build_the_config(launched) -> None:
    args = [
        "--nproc-per-node", "4", "-r", "0:3,1:1,9:3", "-t", "2", "--local-ranks-filter", "0,2", "--log-dir", "logs",
        "--signals-to-handle", "sigterm,USR1,10", "--role", "trainer", "--virtual-local-rank", "--max-restarts", "2",
        "--local-addr", "10.0.0.9", "train.py",
    ]  # fmt: skip
    config = config_of(launched, args)
    assert config.redirects == (Std.ALL, Std.OUT, Std.NONE, Std.NONE)
    assert config.tee == (Std.ERR,) * 4
    assert config.local_ranks_filter == frozenset({0, 2}) and config.log_dir == Path("logs")
    assert config.signals_to_handle == (signal.SIGTERM, signal.SIGUSR1)  # 10 is SIGUSR1 on Linux: kept once
    assert (config.role, config.virtual_local_rank) == ("trainer", True)
    assert (config.max_restarts, config.local_addr) == (2, "10.0.0.9")


def test_shutdown_timeout_from_torch_env_and_flag(launched) -> None:
    assert config_of(launched, ["train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}).timeouts.shutdown_timeout == 5
    config = config_of(launched, ["--shutdown-timeout", "7", "train.py"], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})
    assert config.timeouts.shutdown_timeout == 7


def test_nproc_gpu_and_auto(launched, monkeypatch) -> None:
    monkeypatch.setattr(cli_parse, "_cuda_device_count", lambda: 3)
    assert config_of(launched, ["--nproc-per-node", "gpu", "train.py"]).nproc_per_node == 3
    assert config_of(launched, ["--nproc-per-node", "auto", "train.py"]).nproc_per_node == 3
    monkeypatch.setattr(cli_parse, "_cuda_device_count", lambda: 0)
    result = invoke(["--nproc-per-node", "gpu", "train.py"])
    assert result.exit_code == 2 and "CUDA is not available" in result.stderr
    assert config_of(launched, ["--nproc-per-node", "auto", "train.py"]).nproc_per_node == (os.cpu_count() or 1)
    assert config_of(launched, ["--nproc-per-node", "cpu", "train.py"]).nproc_per_node == (os.cpu_count() or 1)


# --- launch and report dispatch ------------------------------------------------------------------------------


def test_exit_code_is_the_launchers(monkeypatch) -> None:
    monkeypatch.setattr(swiftrun.launcher, "launch", lambda config: 7, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train.py"])
    assert exit_info.value.code == 7


def test_swiftrun_error_from_the_launcher_is_one_line(monkeypatch, capsys) -> None:
    def fail(config):
        raise LaunchError("port 29500 is in use")

    monkeypatch.setattr(swiftrun.launcher, "launch", fail, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train.py"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "swiftrun: error: port 29500 is in use\n"


def test_main_reports_config_errors_on_stderr(launched, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--nnodes", "2", "train.py"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("swiftrun: error: several nodes with the static backend need")


def test_report_is_dispatched(monkeypatch, launched) -> None:
    calls: list[list[str]] = []
    fake = types.ModuleType("swiftrun.report")

    def fake_main(argv: list[str]) -> int:
        calls.append(argv)
        return 5

    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "swiftrun.report", fake)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "events.jsonl", "--nproc-per-node", "3"])
    assert exit_info.value.code == 5
    assert calls == [["events.jsonl", "--nproc-per-node", "3"]]
    assert launched == []


def test_report_errors_are_one_line(monkeypatch, capsys) -> None:
    def fail(argv):
        raise ConfigError("no such event log: x.jsonl")

    fake = types.ModuleType("swiftrun.report")
    fake.main = fail  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "swiftrun.report", fake)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "x.jsonl"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "swiftrun: error: no such event log: x.jsonl\n"


def test_help_groups_flags_into_panels() -> None:
    result = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    for panel in ("Workers", "Rendezvous", "Restarts and recovery", "Logs", "Dashboard", "Fault injection"):
        assert panel in result.output
    assert "swiftrun report EVENTLOG" in result.output
    assert "--master-port" in result.output and "--master_port" not in result.output  # one spelling shown
    assert CliRunner().invoke(cli.app, ["-h"]).exit_code == 0


# --- pure helpers --------------------------------------------------------------------------------------------


def test_parse_nproc_per_node() -> None:
    assert cli.parse_nproc_per_node("4") == 4
    assert cli.parse_nproc_per_node("cpu", cpu_count=lambda: 12) == 12
    assert cli.parse_nproc_per_node("gpu", cuda_count=lambda: 8) == 8
    assert cli.parse_nproc_per_node("auto", cpu_count=lambda: 12, cuda_count=lambda: 2) == 2
    assert cli.parse_nproc_per_node("auto", cpu_count=lambda: 12, cuda_count=lambda: 0) == 12
    with pytest.raises(ConfigError, match="CUDA is not available"):
        cli.parse_nproc_per_node("gpu", cuda_count=lambda: 0)
    with pytest.raises(ConfigError):
        cli.parse_nproc_per_node("xpu")


def test_parse_nnodes() -> None:
    assert cli.parse_nnodes("1") == (1, 1)
    assert cli.parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "2:1", "", "1:", "a:b"):
        with pytest.raises(ConfigError):
            cli.parse_nnodes(bad)


def test_parse_std() -> None:
    assert cli.parse_std("0", 2, "-r") == ()
    assert cli.parse_std("3", 2, "-r") == (Std.ALL, Std.ALL)
    assert cli.parse_std("1:2", 3, "-r") == (Std.NONE, Std.ERR, Std.NONE)
    assert cli.parse_std("0:0", 3, "-r") == ()
    assert cli.parse_std("0:1,5:3", 2, "-r") == (Std.OUT, Std.NONE)  # local rank 5 is not on this node
    for bad in ("4", "-1", "1:", ":1", "0:1,1", "", "a"):
        with pytest.raises(ConfigError):
            cli.parse_std(bad, 2, "-r")


def test_parse_signals() -> None:
    assert cli.parse_signals("SIGTERM,SIGINT") == (signal.SIGTERM, signal.SIGINT)
    assert cli.parse_signals("usr2, SIGusr1") == (signal.SIGUSR2, signal.SIGUSR1)
    assert cli.parse_signals(str(int(signal.SIGHUP))) == (signal.SIGHUP,)
    for bad in ("SIGNOPE", "SIGSTOP", "", "999"):
        with pytest.raises(ConfigError):
            cli.parse_signals(bad)


def test_parse_rdzv_conf_and_endpoint() -> None:
    assert cli.parse_rdzv_conf("") == ()
    assert cli.parse_rdzv_conf("a=1,b=x=y") == (("a", "1"), ("b", "x=y"))
    for bad in ("a", "=1", "a=", "a=1,,b=2"):
        with pytest.raises(ConfigError):
            cli.parse_rdzv_conf(bad)
    assert cli.parse_endpoint("host:1", None) == ("host", 1)
    assert cli.parse_endpoint("host", 29400) == ("host", 29400)
    assert cli.parse_endpoint("[fe80::1]:7", None) == ("fe80::1", 7)
    assert cli.parse_endpoint("fe80::1", 9) == ("fe80::1", 9)
    for bad in (":1", "h:x", "h:70000", "[::1]x"):
        with pytest.raises(ConfigError):
            cli.parse_endpoint(bad, None)


def test_parse_local_ranks_filter() -> None:
    assert cli.parse_local_ranks_filter("") is None
    assert cli.parse_local_ranks_filter("0,1") == frozenset({0, 1})
    with pytest.raises(ConfigError):
        cli.parse_local_ranks_filter("0;1")


# --- swiftrun coordinator ----------------------------------------------------------------------------------------


@pytest.fixture
def coordinated(monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    """Every config handed to swiftrun.launcher.coordinate, which returns 3 without serving anything."""
    configs: list[LaunchConfig] = []

    def fake(config: LaunchConfig) -> int:
        configs.append(config)
        return 3

    monkeypatch.setattr(swiftrun.launcher, "coordinate", fake, raising=False)
    return configs


def test_coordinator_takes_the_agents_command_line(coordinated, launched, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_NODEID", "1")  # an agent's node rank means nothing to the coordinator
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["coordinator", "--nnodes", "2", "--nproc_per_node", "2", "--node-rank", "1", "--rdzv-backend",
                  "c10d", "--rdzv-endpoint", "10.0.0.9:29400", "--rdzv-id", "j1", "train.py", "--lr", "3"])
    assert exit_info.value.code == 3  # the job's status
    assert launched == [] and len(coordinated) == 1
    config = coordinated[0]
    assert (config.node_rank, config.external_coordinator, config.multinode) == (0, True, True)
    assert (config.master_addr, config.master_port, config.world_size) == ("10.0.0.9", 29400, 4)
    assert list(config.entrypoint.args) == ["--lr", "3"]


def test_coordinator_needs_no_copy_of_the_script(coordinated) -> None:
    with pytest.raises(SystemExit):
        cli.main(["coordinator", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5", "elsewhere.py"])
    assert coordinated[0].entrypoint.target == "elsewhere.py"


def test_coordinator_refuses_standalone(coordinated, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["coordinator", "--standalone", "--nnodes", "2", "train.py"])
    assert exit_info.value.code == 2
    assert "swiftrun coordinator serves a multi-node job" in capsys.readouterr().err
    assert coordinated == []


def test_connect_timeout_from_rdzv_conf(launched) -> None:
    config = config_of(launched, ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:5",
                                  "--external-coordinator", "--rdzv-conf", "connect_timeout=3", "train.py"])
    assert config.timeouts.connect_timeout == 3.0 and config.external_coordinator
