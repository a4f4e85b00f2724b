"""From the flags a user gave to one :class:`~swiftrun.config.LaunchConfig`: :func:`build_config`.

The command line is parsed by typer (:mod:`swiftrun.cli.command`), which also reads a flag's ``PET_<NAME>`` or
``SWIFTRUN_<NAME>`` when it is absent; what comes out is a :class:`Flags`, one field per flag, as text or
number, untouched. Everything after that is here, as a pure function of the flags and an explicit environment
mapping: the rules that tie flags together (Slurm's defaults, the coordinator's own node rank, torchrun's
rendezvous rules, ``--rdzv-conf`` keys, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and every value's validation. It
imports no typer, reads no ``os.environ`` and starts nothing, so the rules are tested directly
(``tests/unit/test_build_config.py``); the only outside facts it consults are whether the script exists and,
for ``--nproc-per-node gpu|auto``, how many GPUs there are.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from swiftrun.cli.parse import (
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_rdzv_conf,
    parse_endpoint,
    parse_signals,
    parse_size_flag,
    parse_std,
)
from swiftrun.cluster import slurm_defaults
from swiftrun.config import Entrypoint, EntrypointKind, ExactUndo, FaultSpec, LaunchConfig, RecoveryMode, Timeouts
from swiftrun.errors import ConfigError

C10D_DEFAULT_PORT = 29400  # torch's c10d rendezvous default
SHUTDOWN_TIMEOUT_DEFAULT = 30.0
JOIN_TIMEOUT_DEFAULT = 120.0  # multi-node: how long an agent waits for the coordinator (--rdzv-conf join_timeout)
CONNECT_TIMEOUT_DEFAULT = 30.0  # --external-coordinator: how long a refused connection is retried (connect_timeout)
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
START_METHODS = ("spawn", "fork", "forkserver")
RDZV_BACKENDS = ("static", "c10d")


@dataclass(frozen=True)
class Flags:
    """What the command line said, one field per flag, before any rule is applied.

    The defaults are torchrun's and swiftrun's documented defaults; the typer declarations take theirs from
    here, so ``swiftrun --help`` and :func:`build_config` cannot disagree. ``None`` means "not given", where a
    rule depends on it (Slurm fills ``--nnodes`` only when it was not given).
    """

    script: str
    script_args: tuple[str, ...] = ()
    # workers
    nproc_per_node: str = "1"
    nnodes: str | None = None
    node_rank: int | None = None
    spare_nodes: int = 0
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    role: str = "default"
    virtual_local_rank: bool = False
    start_method: str = "spawn"
    python: str | None = None
    # rendezvous
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str = ""
    rdzv_id: str | None = None
    rdzv_conf: str = ""
    standalone: bool = False
    local_addr: str | None = None
    external_coordinator: bool = False
    node_lease: float = 5.0
    node_timeout: float = 10.0
    # restarts
    max_restarts: int = 0
    monitor_interval: float = 0.1
    signals_to_handle: str = DEFAULT_SIGNALS
    shutdown_timeout: float | None = None
    # swiftrun's recovery
    recovery: str = "auto"
    max_recoveries: int = 16
    startup_restarts: int = 3
    verify_every: int = 0
    exact_undo: bool | None = None  # None: auto
    transfer_chunk_mb: int = 0
    log_budget: str | None = None
    log_memory: str | None = None
    parallel_replay: int | None = None
    stage_ckpt_dir: Path | None = None
    spares: int = 1
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 30.0
    progress_timeout: float = 0.0
    recovery_timeout: float = 120.0
    startup_timeout: float = 600.0
    # logs, dashboard, faults
    log_dir: Path | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    event_log: Path | None = None
    dashboard: bool | None = None
    fault: tuple[str, ...] = ()
    # torchrun flags swiftrun parses and refuses
    logs_specs: str | None = None
    numa_binding: str | None = None
    event_log_handler: str = "null"
    duplicate_stdout_filters: str = ""
    duplicate_stderr_filters: str = ""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def build_config(
    flags: Flags,
    environ: Mapping[str, str],
    *,
    coordinator: bool = False,
    cuda_count: Callable[[], int] | None = None,
    new_id: Callable[[], str] = lambda: str(uuid.uuid4()),
) -> LaunchConfig:
    """The launch the flags describe, or a :class:`~swiftrun.errors.ConfigError` naming what is wrong.

    ``environ`` is read for Slurm's step variables and ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` only (``PET_*`` and
    ``SWIFTRUN_*`` were read into ``flags`` already). ``coordinator``: ``swiftrun coordinator`` parsing the
    agents' command line, which makes this host node 0 of no training node and the script a name only.
    """
    f = flags
    refused_flags(
        logs_specs=f.logs_specs,
        numa_binding=f.numa_binding,
        event_log_handler=f.event_log_handler,
        duplicate_stdout_filters=f.duplicate_stdout_filters,
        duplicate_stderr_filters=f.duplicate_stderr_filters,
    )
    nnodes, node_rank, rdzv_id = f.nnodes, f.node_rank, f.rdzv_id
    rdzv_backend, rdzv_endpoint = f.rdzv_backend, f.rdzv_endpoint
    external_coordinator = f.external_coordinator
    cluster = slurm_defaults(environ, f.spare_nodes)
    if cluster is not None:  # a flag given (or read from PET_*) always wins over Slurm
        nnodes = nnodes if nnodes is not None else cluster.nnodes
        node_rank = node_rank if node_rank is not None else cluster.node_rank
        rdzv_id = rdzv_id if rdzv_id is not None else cluster.rdzv_id
        if not rdzv_endpoint.strip() and rdzv_backend is None and cluster.endpoint_host and not f.standalone \
                and f.master_port is None:
            rdzv_backend, rdzv_endpoint = "c10d", cluster.endpoint_host
    nodes = parse_nnodes(nnodes if nnodes is not None else "1:1")
    node_rank = node_rank if node_rank is not None else 0
    if node_rank < 0:
        raise ConfigError(f"--node-rank must be >= 0 (got {node_rank})")
    if coordinator:
        # the coordinator takes the agents' command line (it refuses agents whose job differs from it), so
        # their --node-rank or $SLURM_NODEID means nothing here; it is the external coordinator by definition
        node_rank, external_coordinator = 0, True
        if f.standalone:
            raise ConfigError("swiftrun coordinator serves a multi-node job: give --rdzv-endpoint HOST:PORT, "
                              "not --standalone")
    multinode = nodes != (1, 1) or node_rank != 0 or external_coordinator
    conf = parse_rdzv_conf(f.rdzv_conf)
    if f.start_method not in START_METHODS:
        raise ConfigError(f"--start-method {f.start_method!r} is not one of {', '.join(START_METHODS)}")
    entrypoint = resolve_entrypoint(
        f.script, list(f.script_args), module=f.module, no_python=f.no_python, run_path=f.run_path,
        must_exist=not coordinator,
    )
    try:
        recovery_mode = RecoveryMode(f.recovery)
    except ValueError:
        choices = ", ".join(mode.value for mode in RecoveryMode)
        raise ConfigError(f"--recovery {f.recovery!r} is not one of {choices}") from None
    rdzv = resolve_rendezvous(
        backend=(rdzv_backend or "static").strip(),
        endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id if rdzv_id is not None else "none",
        master_addr=f.master_addr,
        master_port=f.master_port,
        standalone=f.standalone,
        multinode=multinode,
        new_id=new_id,
    )
    nproc = parse_nproc_per_node(f.nproc_per_node, cuda_count=cuda_count)
    return LaunchConfig(
        entrypoint=entrypoint,
        nproc_per_node=nproc,
        nnodes=nodes,
        node_rank=node_rank,
        master_addr=rdzv.master_addr,
        master_port=rdzv.master_port,
        rdzv_backend=rdzv.backend,
        rdzv_endpoint=rdzv.endpoint,
        rdzv_id=rdzv.rdzv_id,
        rdzv_conf=conf,
        standalone=f.standalone,
        max_restarts=f.max_restarts,
        monitor_interval=f.monitor_interval,
        role=f.role,
        local_addr=f.local_addr,
        log_dir=f.log_dir,
        redirects=parse_std(f.redirects, nproc, "--redirects"),
        tee=parse_std(f.tee, nproc, "--tee"),
        local_ranks_filter=parse_local_ranks_filter(f.local_ranks_filter),
        signals_to_handle=parse_signals(f.signals_to_handle),
        virtual_local_rank=f.virtual_local_rank,
        timeouts=Timeouts(
            heartbeat_interval=f.heartbeat_interval,
            heartbeat_timeout=f.heartbeat_timeout,
            progress_timeout=f.progress_timeout,
            shutdown_timeout=_shutdown_timeout(f.shutdown_timeout, environ),
            recovery_timeout=f.recovery_timeout,
            startup_timeout=f.startup_timeout,
            node_lease=f.node_lease,
            node_timeout=f.node_timeout,
            join_timeout=_conf_seconds(conf, "join_timeout", JOIN_TIMEOUT_DEFAULT),
            connect_timeout=_conf_seconds(conf, "connect_timeout", CONNECT_TIMEOUT_DEFAULT),
        ),
        recovery=recovery_mode,
        max_recoveries=f.max_recoveries,
        startup_restarts=f.startup_restarts,
        verify_every=f.verify_every,
        exact_undo={True: ExactUndo.ON, False: ExactUndo.OFF}.get(f.exact_undo, ExactUndo.AUTO),
        transfer_chunk_mb=f.transfer_chunk_mb,
        log_budget=parse_size_flag(f.log_budget, "--log-budget"),
        log_memory=parse_size_flag(f.log_memory, "--log-memory"),
        stage_ckpt_dir=f.stage_ckpt_dir,
        parallel_replay=f.parallel_replay,
        spares=f.spares,
        dashboard=f.dashboard,
        event_log=f.event_log,
        faults=tuple(FaultSpec.parse(text) for text in f.fault),
        python=f.python or "",
        external_coordinator=external_coordinator,
        control_port=int(_conf_seconds(conf, "control_port", 0)),
    )


@dataclass(frozen=True)
class Rendezvous:
    backend: str
    endpoint: str
    rdzv_id: str
    master_addr: str
    master_port: int  # 0: pick a free port


def resolve_rendezvous(
    *,
    backend: str,
    endpoint: str,
    rdzv_id: str,
    master_addr: str,
    master_port: int | None,
    standalone: bool,
    multinode: bool = False,
    new_id: Callable[[], str] = lambda: str(uuid.uuid4()),
) -> Rendezvous:
    """torchrun's rendezvous rules (``run.py::run`` and ``get_rdzv_endpoint``).

    - ``--standalone``: c10d on ``localhost:0`` (a free port) with a random id; explicit rdzv flags are ignored.
    - static with no ``--rdzv-endpoint`` and no ``--master-port``: the same as ``--standalone`` (what torchrun
      does for a single node since it made ``--master-port`` optional): a free port instead of 29500. Unlike
      torchrun, an explicit ``--rdzv-id`` is kept rather than replaced by a random one.
    - static: the endpoint (which needs a port) or ``master_addr:master_port`` is where the store lives.
    - c10d: the endpoint's host and port (default 29400; default host localhost) are where the store lives.
    - several nodes: every agent must name the same store, so static needs ``--master-port`` or an endpoint.
    """
    if standalone:
        return Rendezvous("c10d", "localhost:0", new_id(), master_addr, 0)
    if backend in ("etcd", "etcd-v2"):
        raise ConfigError(f"--rdzv-backend {backend} is not supported by swiftrun; use static or c10d")
    if backend not in RDZV_BACKENDS:
        raise ConfigError(f"--rdzv-backend {backend!r} is unknown; use static or c10d")
    if backend == "static":
        if endpoint.strip():
            host, port = parse_endpoint(endpoint, default_port=None)
            if port is None:
                raise ConfigError(f"--rdzv-endpoint {endpoint!r} needs a port with the static backend")
            return Rendezvous("static", endpoint.strip(), rdzv_id, host, port)
        if master_port is None and multinode:
            raise ConfigError("several nodes with the static backend need --master-addr and --master-port (or "
                              "--rdzv-endpoint HOST:PORT): every node must find the same store")
        if master_port is None:  # torchrun replaces the id here too; an id the user chose is kept
            return Rendezvous("c10d", "localhost:0", rdzv_id if rdzv_id != "none" else new_id(), master_addr, 0)
        return Rendezvous("static", f"{master_addr}:{master_port}", rdzv_id, master_addr, master_port)
    if not endpoint.strip():
        return Rendezvous("c10d", f"localhost:{C10D_DEFAULT_PORT}", rdzv_id, master_addr, C10D_DEFAULT_PORT)
    host, port = parse_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)
    assert port is not None
    return Rendezvous("c10d", endpoint.strip(), rdzv_id, host, port)


def resolve_entrypoint(target: str, args: list[str], *, module: bool, no_python: bool, run_path: bool,
                       must_exist: bool = True) -> Entrypoint:
    """Which kind of worker to start; ``--run-path`` takes precedence over ``--no-python``, as in torchrun.
    ``must_exist=False``: the script runs elsewhere (`swiftrun coordinator` only names the job's script)."""
    if module and no_python:
        raise ConfigError("--no-python and -m/--module cannot be used together")
    if run_path:
        kind = EntrypointKind.SCRIPT
    elif no_python:
        kind = EntrypointKind.EXECUTABLE
    elif module:
        kind = EntrypointKind.MODULE
    else:
        kind = EntrypointKind.SCRIPT
    if must_exist and kind is EntrypointKind.SCRIPT and not os.path.exists(target):
        raise ConfigError(f"training script {target!r} not found")
    return Entrypoint(kind=kind, target=target, args=tuple(args), run_path=run_path)


def refused_flags(
    *,
    logs_specs: str | None,
    numa_binding: str | None,
    event_log_handler: str,
    duplicate_stdout_filters: str,
    duplicate_stderr_filters: str,
) -> None:
    """Refuse torchrun flags that swiftrun parses but does not implement."""
    given = [
        ("--logs-specs", logs_specs is not None),
        ("--numa-binding", numa_binding is not None),
        ("--event-log-handler", event_log_handler.strip() != "null"),
        ("--duplicate-stdout-filters", bool(duplicate_stdout_filters)),
        ("--duplicate-stderr-filters", bool(duplicate_stderr_filters)),
    ]
    for flag, present in given:
        if present:
            raise ConfigError(f"{flag} is a torchrun flag that swiftrun does not implement; remove it or use torchrun")


def _conf_seconds(conf: tuple[tuple[str, str], ...], key: str, default: float) -> float:
    """A number from --rdzv-conf (``join_timeout=30``, ``control_port=29401``), else ``default``."""
    for name, value in conf:
        if name == key:
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}={value!r} is not a number") from None
    return default


def _shutdown_timeout(flag: float | None, environ: Mapping[str, str]) -> float:
    if flag is not None:
        return flag
    env = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
    if not env:
        return SHUTDOWN_TIMEOUT_DEFAULT
    try:
        return float(env)
    except ValueError:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env!r} is not a number of seconds") from None

