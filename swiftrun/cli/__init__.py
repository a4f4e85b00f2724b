"""The ``swiftrun`` command: torchrun's flags in, one :class:`~swiftrun.config.LaunchConfig` out.

``swiftrun train.py`` takes what ``torchrun train.py`` takes (``torch/distributed/run.py``): every flag in its
dashed and underscored spelling, every torchrun flag also read from ``PET_<NAME>`` (the command line wins), a
unique prefix of a long flag (argparse's ``allow_abbrev``), and everything from the script on handed to the
script untouched. swiftrun's own flags read ``SWIFTRUN_<NAME>``. torchrun flags that swiftrun does not implement
are accepted by the parser and then refused with an error naming them, never silently ignored.

This module only parses. It builds the config and hands it to :func:`swiftrun.launcher.launch`; a
:class:`~swiftrun.errors.SwiftrunError` from anywhere below becomes ``swiftrun: error: <message>`` and its exit
code. ``swiftrun report ...`` is dispatched to :mod:`swiftrun.report`, ``swiftrun plan ...`` to
:mod:`swiftrun.cli.plan`; ``swiftrun coordinator FLAGS SCRIPT ...`` parses the launcher's command line
and runs the job's coordinator (:func:`swiftrun.launcher.coordinate`) instead of a node.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from swiftrun.cluster import slurm_defaults
from swiftrun.config import Entrypoint, EntrypointKind, FaultSpec, LaunchConfig, RecoveryMode, Std, Timeouts
from swiftrun.errors import ConfigError, SwiftrunError

# ---------------------------------------------------------------------------------------------------------------
# Pure parsing helpers: str in, typed value out, ConfigError on anything malformed.
# ---------------------------------------------------------------------------------------------------------------

C10D_DEFAULT_PORT = 29400  # torch's c10d rendezvous default
MASTER_PORT_DEFAULT = 29500
SHUTDOWN_TIMEOUT_DEFAULT = 30.0
JOIN_TIMEOUT_DEFAULT = 120.0  # multi-node: how long an agent waits for the coordinator (--rdzv-conf join_timeout)
CONNECT_TIMEOUT_DEFAULT = 30.0  # --external-coordinator: how long a refused connection is retried (connect_timeout)
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
START_METHODS = ("spawn", "fork", "forkserver")
RDZV_BACKENDS = ("static", "c10d")
_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> ``(min, max)`` with ``0 < min <= max``."""
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} is not N or MIN:MAX") from None
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {text!r} must satisfy 0 < MIN <= MAX")
    return lo, hi


def _cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        raise ConfigError("--nproc-per-node gpu/auto needs torch, which is not importable") from None
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_nproc_per_node(
    text: str,
    *,
    cpu_count: Callable[[], int | None] = os.cpu_count,
    cuda_count: Callable[[], int] | None = None,
) -> int:
    """An int, ``cpu`` (CPU count), ``gpu`` (CUDA devices; an error if none) or ``auto`` (GPUs, else CPUs)."""
    value = text.strip()
    try:
        return int(value)
    except ValueError:
        pass
    cuda_count = cuda_count or _cuda_device_count
    if value == "cpu":
        return cpu_count() or 1
    if value == "gpu":
        count = cuda_count()
        if count < 1:
            raise ConfigError("--nproc-per-node gpu: CUDA is not available (no GPU found)")
        return count
    if value == "auto":
        return cuda_count() or cpu_count() or 1
    raise ConfigError(f"--nproc-per-node {text!r} is not an integer or one of auto, cpu, gpu")


def parse_std(text: str, nproc: int, flag: str) -> tuple[Std, ...]:
    """torchrun's -r/-t value: ``0``..``3`` for every local rank, or ``LR:V,LR:V`` per local rank.

    Returns one entry per local rank, or ``()`` when nothing is redirected (LaunchConfig's "all NONE"). As in
    torchrun, local ranks this node does not have are ignored, so one command line fits nodes of any size.
    """
    value = text.strip()
    bad = ConfigError(f"{flag} {text!r} is not 0-3 or LOCAL_RANK:VALUE,... (1 stdout, 2 stderr, 3 both)")

    def to_std(v: str) -> Std:
        if v.strip() not in ("0", "1", "2", "3"):
            raise bad
        return Std(int(v))

    if ":" not in value:
        per_rank = (to_std(value),) * nproc
    else:
        mapping: dict[int, Std] = {}
        for item in value.split(","):
            rank, sep, v = item.partition(":")
            if not sep or not rank.strip().isdigit():
                raise bad
            mapping[int(rank)] = to_std(v)
        per_rank = tuple(mapping.get(r, Std.NONE) for r in range(nproc))
    return per_rank if any(per_rank) else ()


def parse_local_ranks_filter(text: str) -> frozenset[int] | None:
    """``0,1,2`` -> ``frozenset({0, 1, 2})``; empty -> None (every rank shows on the console)."""
    if not text.strip():
        return None
    try:
        return frozenset(int(item) for item in text.split(","))
    except ValueError:
        raise ConfigError(f"--local-ranks-filter {text!r} is not a comma-separated list of local ranks") from None


def parse_signals(text: str) -> tuple[int, ...]:
    """``SIGTERM,SIGUSR1`` -> signal numbers. Names are case-insensitive, ``SIG`` is optional, numbers pass."""
    numbers: list[int] = []
    for item in text.split(","):
        name = item.strip()
        if not name:
            continue
        try:
            sig = signal.Signals(int(name)) if name.isdigit() else signal.Signals[_signal_name(name)]
        except (KeyError, ValueError):
            raise ConfigError(f"--signals-to-handle: unknown signal {name!r}") from None
        if sig in _UNCATCHABLE:
            raise ConfigError(f"--signals-to-handle: {sig.name} cannot be caught")
        if sig not in numbers:
            numbers.append(sig)
    if not numbers:
        raise ConfigError("--signals-to-handle names no signal")
    return tuple(numbers)


def _signal_name(name: str) -> str:
    upper = name.upper()
    return upper if upper.startswith("SIG") else f"SIG{upper}"


def parse_rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k=v`` -> ``(("k", "v"), ...)``; keys and values must be non-empty, as in torchrun."""
    pairs: list[tuple[str, str]] = []
    if not text.strip():
        return ()
    for item in text.split(","):
        key, _, value = item.partition("=")
        if not key.strip() or not value.strip():
            raise ConfigError(f"--rdzv-conf {text!r} is not KEY=VALUE,KEY=VALUE,...")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def parse_endpoint(text: str, default_port: int | None) -> tuple[str, int | None]:
    """``host[:port]`` (IPv6 as ``[addr]:port``) -> ``(host, port)``; a missing port gives ``default_port``."""
    value = text.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else None
        if rest and port_text is None:
            raise ConfigError(f"--rdzv-endpoint {text!r} is not HOST[:PORT]")
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address
        host, port_text = value, None
    if not host:
        raise ConfigError(f"--rdzv-endpoint {text!r} has no host")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or int(port_text) >= 65536:
        raise ConfigError(f"--rdzv-endpoint {text!r}: the port must be an integer in 0..65535")
    return host, int(port_text)


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


# ---------------------------------------------------------------------------------------------------------------
# The typer app.
# ---------------------------------------------------------------------------------------------------------------

WORKERS = "Workers"
RENDEZVOUS = "Rendezvous"
RESTARTS = "Restarts and recovery"
SWIFT = "Swift recovery (swiftrun)"
LOGS = "Logs"
DASHBOARD = "Dashboard"
FAULTS = "Fault injection (tests and demos)"

EPILOG = (
    "Every torchrun flag is also read from PET_<NAME> (PET_NPROC_PER_NODE=4), swiftrun's own from "
    "SWIFTRUN_<NAME>; the command line wins. Underscored spellings (--nproc_per_node) work too.\n\n"
    "Summarise a run recorded with --event-log EVENTLOG: swiftrun report EVENTLOG\n\n"
    "Run a multi-node job's store and control plane on a host that trains nothing: swiftrun coordinator "
    "FLAGS SCRIPT [ARGS] (the agents' command line; agents then add --external-coordinator)\n\n"
    "Choose which pipeline boundaries to log under a storage budget: swiftrun plan --help"
)


def _env_name(prefix: str, decls: tuple[str, ...]) -> str:
    longest = max((d.split("/")[0] for d in decls), key=len)  # torchrun: PET_ + the longest spelling
    return prefix + longest.lstrip("-").replace("-", "_").upper()


def _torchrun(*decls: str, env: bool = True, **kwargs: Any) -> Any:
    """A torchrun flag: env ``PET_<NAME>`` (except the two torchrun reads no env for)."""
    return _option(decls, _env_name("PET_", decls) if env else None, **kwargs)


def _own(*decls: str, **kwargs: Any) -> Any:
    """A swiftrun flag: env ``SWIFTRUN_<NAME>``."""
    return _option(decls, _env_name("SWIFTRUN_", decls), **kwargs)


def _option(
    decls: tuple[str, ...],
    envvar: str | None,
    *,
    help: str,
    panel: str | None = None,
    metavar: str | None = None,
    show_default: bool | str = True,
    hidden: bool = False,
) -> Any:
    return typer.Option(
        *decls,
        envvar=envvar,
        show_envvar=False,
        help=help,
        rich_help_panel=panel,
        metavar=metavar,
        show_default=show_default,
        hidden=hidden,
    )


class _LongFlagNormalizer:
    """click's ``token_normalize_func``: ``nproc_per_node`` -> ``nproc-per-node``, and a unique prefix -> its flag.

    click calls it with option names stripped of their dashes; it also calls it when building the parser, so it
    learns the long names then. Single letters are left alone (short options such as ``-t``).
    """

    def __init__(self) -> None:
        self.long_names: set[str] = set()

    def __call__(self, name: str) -> str:
        name = name.replace("_", "-")
        if len(name) < 2 or name in self.long_names:
            return name
        matches = [known for known in self.long_names if known.startswith(name)]
        return matches[0] if len(matches) == 1 else name

    def learn(self, command: Any) -> None:
        for param in command.params:
            for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
                if opt.startswith("--"):
                    self.long_names.add(opt[2:])


_normalize = _LongFlagNormalizer()

app = typer.Typer(
    name="swiftrun",
    help="Launch SCRIPT on local workers exactly like torchrun, and recover failed ranks in place.",
    epilog=EPILOG,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={
        "allow_interspersed_args": False,  # everything after SCRIPT belongs to the script
        "help_option_names": ["-h", "--help"],
        "token_normalize_func": _normalize,
    },
)


def _fail(err: SwiftrunError) -> NoReturn:
    typer.echo(f"swiftrun: error: {err}", err=True)
    raise typer.Exit(err.exit_code)


COORDINATOR = "coordinator"  # ctx.obj when `swiftrun coordinator ...` parses its (the launcher's) flags
COORDINATOR_HELP = (
    "Run a multi-node job's c10d store and control plane on this host, which trains nothing: give it the agents' "
    "own command line (FLAGS SCRIPT ARGS, no --node-rank) and start every agent with --external-coordinator. "
    "Losing any training node, node 0 included, is then recovered in place. Exits with the job's status."
)


@app.command(epilog=EPILOG)
def launch(
    ctx: typer.Context,
    script: Annotated[
        str,
        typer.Argument(
            metavar="SCRIPT",
            help="Training script (a module with -m, a program with --no-python).", show_default=False,
        ),
    ],
    script_args: Annotated[
        list[str] | None, typer.Argument(metavar="ARGS", help="Handed to the script untouched.", show_default=False)
    ] = None,
    # Workers
    nproc_per_node: Annotated[
        str, _torchrun("--nproc-per-node", panel=WORKERS, metavar="N|auto|cpu|gpu", help="Workers on this node.")
    ] = "1",
    nnodes: Annotated[
        str | None,
        _torchrun(
            "--nnodes", panel=WORKERS, metavar="N|MIN:MAX", show_default="1, or Slurm's node count",
            help="Training nodes; with MIN:MAX, MIN train and node ranks MIN..MAX-1 are hot spares.",
        ),
    ] = None,
    node_rank: Annotated[
        int | None,
        _torchrun(
            "--node-rank", panel=WORKERS, show_default="0, or $SLURM_NODEID",
            help="Rank of this node; >= --nnodes: a hot-spare node.",
        ),
    ] = None,
    spare_nodes: Annotated[
        int,
        _own("--spare-nodes", panel=WORKERS,
             help="Under Slurm: the last N nodes of the allocation are hot spares (--nnodes = nodes - N)."),
    ] = 0,
    module: Annotated[
        bool, _torchrun("-m", "--module", panel=WORKERS, help="Run SCRIPT as a module, like python -m.")
    ] = False,
    no_python: Annotated[
        bool, _torchrun("--no-python", panel=WORKERS, help="Execute SCRIPT directly, without python.")
    ] = False,
    run_path: Annotated[
        bool, _torchrun("--run-path", panel=WORKERS, help="Run SCRIPT with runpy.run_path (wins over --no-python).")
    ] = False,
    role: Annotated[
        str, _torchrun("--role", panel=WORKERS, help=r"Role name, shown in the \[role0]: log prefix.")
    ] = "default",
    virtual_local_rank: Annotated[
        bool,
        _torchrun(
            "--virtual-local-rank", panel=WORKERS,
            help="LOCAL_RANK=0 for all; each worker sees only its GPU.",
        ),
    ] = False,
    start_method: Annotated[
        str,
        _torchrun(
            "--start-method", panel=WORKERS, metavar="spawn|fork|forkserver",
            help="Accepted for torchrun compatibility (no effect on scripts).",
        ),
    ] = "spawn",
    python: Annotated[
        str | None,
        _own(
            "--python", panel=WORKERS, metavar="PATH", show_default="$PYTHON_EXEC or this python",
            help="Interpreter for workers.",
        ),
    ] = None,
    # Rendezvous
    master_addr: Annotated[
        str, _torchrun("--master-addr", panel=RENDEZVOUS, help="Address of the store workers connect to.")
    ] = "127.0.0.1",
    master_port: Annotated[
        int | None,
        _torchrun(
            "--master-port", panel=RENDEZVOUS, show_default="a free port",
            help="Port of the store.",
        ),
    ] = None,
    rdzv_backend: Annotated[
        str | None,
        _torchrun(
            "--rdzv-backend", panel=RENDEZVOUS, metavar="static|c10d", show_default="static (c10d under Slurm)",
            help="Rendezvous backend.",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str,
        _torchrun(
            "--rdzv-endpoint", panel=RENDEZVOUS, metavar="HOST[:PORT]",
            help="Rendezvous endpoint (c10d default port 29400).",
        ),
    ] = "",
    rdzv_id: Annotated[
        str | None,
        _torchrun("--rdzv-id", panel=RENDEZVOUS, show_default="none, or $SLURM_JOB_ID",
                  help="Job id (TORCHELASTIC_RUN_ID)."),
    ] = None,
    rdzv_conf: Annotated[
        str, _torchrun("--rdzv-conf", panel=RENDEZVOUS, metavar="K=V,...", help="Extra rendezvous settings.")
    ] = "",
    standalone: Annotated[
        bool, _torchrun("--standalone", panel=RENDEZVOUS, help="Local c10d store on a free port, random id.")
    ] = False,
    local_addr: Annotated[
        str | None, _torchrun("--local-addr", panel=RENDEZVOUS, help="Address this node advertises.")
    ] = None,
    external_coordinator: Annotated[
        bool,
        _own("--external-coordinator", panel=RENDEZVOUS,
             help="The store and control plane run as `swiftrun coordinator` at the endpoint, not in node 0."),
    ] = False,
    node_lease: Annotated[
        float,
        _own("--node-lease", panel=RENDEZVOUS, metavar="SECONDS",
             help="An agent that lost the coordinator this long kills its workers (fencing)."),
    ] = 5.0,
    node_timeout: Annotated[
        float,
        _own("--node-timeout", panel=RENDEZVOUS, metavar="SECONDS",
             help="A node silent this long is lost and its slot handed out again (> --node-lease)."),
    ] = 10.0,
    # Restarts and recovery
    max_restarts: Annotated[
        int, _torchrun("--max-restarts", panel=RESTARTS, help="Whole-group restarts before failing.")
    ] = 0,
    monitor_interval: Annotated[
        float, _torchrun("--monitor-interval", panel=RESTARTS, metavar="SECONDS", help="Worker poll period.")
    ] = 0.1,
    signals_to_handle: Annotated[
        str, _torchrun("--signals-to-handle", panel=RESTARTS, metavar="SIG,...", help="Signals forwarded to workers.")
    ] = DEFAULT_SIGNALS,
    shutdown_timeout: Annotated[
        float | None,
        _torchrun(
            "--shutdown-timeout",
            panel=RESTARTS,
            metavar="SECONDS",
            show_default="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30",
            help="SIGTERM -> SIGKILL grace.",
        ),
    ] = None,
    # swiftrun's own recovery
    recovery: Annotated[
        str,
        _own(
            "--recovery", panel=SWIFT, metavar="auto|roll-forward|undo|restart",
            help="How a failed rank is repaired (restart: like torchrun).",
        ),
    ] = "auto",
    max_recoveries: Annotated[
        int, _own("--max-recoveries", panel=SWIFT, help="In-place recoveries before failing.")
    ] = 16,
    startup_restarts: Annotated[
        int,
        _own(
            "--startup-restarts", panel=SWIFT,
            help="Restarts of every worker after a signal or hang before all ranks reached swiftrun.Run "
                 "(not counted in --max-restarts).",
        ),
    ] = 3,
    verify_every: Annotated[
        int,
        _own("--verify-every", panel=SWIFT, metavar="N",
             help="Also compare every rank's whole state every N steps (0: only after each recovery)."),
    ] = 0,
    exact_undo: Annotated[
        bool,
        _own("--exact-undo/--no-exact-undo", panel=SWIFT,
             help="Copy the parameters and optimizer state before every optimizer step, so that an undone update "
                  "is restored bitwise (costs their memory and a copy per step; default: invert it arithmetically, "
                  "not bitwise: 1.5e-4 relative measured on an AdamW job)."),
    ] = False,
    transfer_chunk_mb: Annotated[
        int,
        _own("--transfer-chunk-mb", panel=SWIFT, metavar="MB",
             help="Chunk size of a recovery's state transfer (0: 16 on the CPU, 64 on a GPU)."),
    ] = 0,
    log_budget: Annotated[
        str | None,
        _own("--log-budget", panel=SWIFT, metavar="SIZE",
             help="Pipelines: bytes of stage-boundary logs to keep (e.g. 2GiB); pipeline ranks (with all their "
                  "stages, also interleaved) are grouped to minimise the expected replay within it (default: log "
                  "every boundary)."),
    ] = None,
    log_memory: Annotated[
        str | None,
        _own("--log-memory", panel=SWIFT, metavar="SIZE",
             help="Pipelines: host memory a rank's boundary logs may use; older entries spill to local disk "
                  "(default 4GiB)."),
    ] = None,
    parallel_replay: Annotated[
        int | None,
        _own("--parallel-replay", panel=SWIFT, metavar="N",
             help="Pipelines: at most N idle survivors help replay each lost stage or logging group (in chains "
                  "of one helper per stage), each taking a contiguous range of its micro-batches (bitwise the same "
                  "result; default: every idle survivor; 0: replay alone)."),
    ] = None,
    stage_ckpt_dir: Annotated[
        Path | None,
        _own("--stage-ckpt-dir", panel=SWIFT, metavar="DIR",
             help="Pipelines: also write every stage checkpoint here (shared storage), so that adjacent stages "
                  "lost together can still be replayed."),
    ] = None,
    spares: Annotated[int, _own("--spares", panel=SWIFT, help="Warm spare workers kept ready to replace a rank.")] = 1,
    heartbeat_interval: Annotated[
        float, _own("--heartbeat-interval", panel=SWIFT, metavar="SECONDS", help="Worker heartbeat period.")
    ] = 0.5,
    heartbeat_timeout: Annotated[
        float, _own("--heartbeat-timeout", panel=SWIFT, metavar="SECONDS", help="Silence after which a worker is hung.")
    ] = 30.0,
    progress_timeout: Annotated[
        float,
        _own(
            "--progress-timeout", panel=SWIFT, metavar="SECONDS",
            help="No new step for this long is a stall (0: off).",
        ),
    ] = 0.0,
    recovery_timeout: Annotated[
        float, _own("--recovery-timeout", panel=SWIFT, metavar="SECONDS", help="Deadline for one in-place recovery.")
    ] = 120.0,
    startup_timeout: Annotated[
        float,
        _own(
            "--startup-timeout", panel=SWIFT, metavar="SECONDS",
            help="Deadline of a worker's start: spawn to hello; a replacement's also to swiftrun.Run.",
        ),
    ] = 600.0,
    # Logs
    log_dir: Annotated[
        Path | None, _torchrun("--log-dir", panel=LOGS, metavar="DIR", help="Base directory for per-rank logs.")
    ] = None,
    redirects: Annotated[
        str,
        _torchrun(
            "-r", "--redirects", panel=LOGS, metavar="0-3|LR:V,...",
            help="Send streams to files (1 out, 2 err, 3 both).",
        ),
    ] = "0",
    tee: Annotated[
        str, _torchrun("-t", "--tee", panel=LOGS, metavar="0-3|LR:V,...", help="Like -r, and also to the console.")
    ] = "0",
    local_ranks_filter: Annotated[
        str,
        _torchrun(
            "--local-ranks-filter", panel=LOGS, metavar="LR,...",
            help="Show only these local ranks on the console.",
        ),
    ] = "",
    event_log: Annotated[
        Path | None,
        _own(
            "--event-log", panel=LOGS, metavar="PATH",
            help="Write a JSON-lines event log (read it with swiftrun report).",
        ),
    ] = None,
    # Dashboard
    dashboard: Annotated[
        bool | None,
        _own(
            "--dashboard/--no-dashboard", panel=DASHBOARD, show_default="on a terminal",
            help="Live dashboard.",
        ),
    ] = None,
    # Fault injection
    fault: Annotated[
        list[str] | None,
        _own(
            "--fault", panel=FAULTS, metavar="RANK:STEP:PHASE:KIND[:every]",
            help="Inject a fault; repeatable.",
        ),
    ] = None,
    # torchrun flags swiftrun parses and refuses
    logs_specs: Annotated[
        str | None, _torchrun("--logs-specs", env=False, hidden=True, help="Not implemented.")
    ] = None,
    numa_binding: Annotated[
        str | None, _torchrun("--numa-binding", env=False, hidden=True, help="Not implemented.")
    ] = None,
    event_log_handler: Annotated[str, _torchrun("--event-log-handler", hidden=True, help="Only null.")] = "null",
    duplicate_stdout_filters: Annotated[
        str, _torchrun("--duplicate-stdout-filters", hidden=True, help="Not implemented.")
    ] = "",
    duplicate_stderr_filters: Annotated[
        str, _torchrun("--duplicate-stderr-filters", hidden=True, help="Not implemented.")
    ] = "",
) -> None:
    """Launch SCRIPT on local workers exactly like torchrun, and recover failed ranks in place."""
    as_coordinator = ctx.obj == COORDINATOR
    try:
        refused_flags(
            logs_specs=logs_specs,
            numa_binding=numa_binding,
            event_log_handler=event_log_handler,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
        cluster = slurm_defaults(os.environ, spare_nodes)
        if cluster is not None:
            nnodes = nnodes if nnodes is not None else cluster.nnodes
            node_rank = node_rank if node_rank is not None else cluster.node_rank
            rdzv_id = rdzv_id if rdzv_id is not None else cluster.rdzv_id
            if not rdzv_endpoint.strip() and rdzv_backend is None and cluster.endpoint_host and not standalone \
                    and master_port is None:
                rdzv_backend, rdzv_endpoint = "c10d", cluster.endpoint_host
        nodes = parse_nnodes(nnodes if nnodes is not None else "1:1")
        node_rank = node_rank if node_rank is not None else 0
        if node_rank < 0:
            raise ConfigError(f"--node-rank must be >= 0 (got {node_rank})")
        if as_coordinator:
            # the coordinator takes the agents' command line (it refuses agents whose job differs from it), so
            # their --node-rank or $SLURM_NODEID means nothing here; it is the external coordinator by definition
            node_rank, external_coordinator = 0, True
            if standalone:
                raise ConfigError("swiftrun coordinator serves a multi-node job: give --rdzv-endpoint HOST:PORT, "
                                  "not --standalone")
        multinode = nodes != (1, 1) or node_rank != 0 or external_coordinator
        conf = parse_rdzv_conf(rdzv_conf)
        if start_method not in START_METHODS:
            raise ConfigError(f"--start-method {start_method!r} is not one of {', '.join(START_METHODS)}")
        entrypoint = resolve_entrypoint(
            script, script_args or [], module=module, no_python=no_python, run_path=run_path,
            must_exist=not as_coordinator,
        )
        try:
            recovery_mode = RecoveryMode(recovery)
        except ValueError:
            choices = ", ".join(mode.value for mode in RecoveryMode)
            raise ConfigError(f"--recovery {recovery!r} is not one of {choices}") from None
        rdzv = resolve_rendezvous(
            backend=(rdzv_backend or "static").strip(),
            endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id if rdzv_id is not None else "none",
            master_addr=master_addr,
            master_port=master_port,
            standalone=standalone,
            multinode=multinode,
        )
        nproc = parse_nproc_per_node(nproc_per_node)
        config = LaunchConfig(
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
            standalone=standalone,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            role=role,
            local_addr=local_addr,
            log_dir=log_dir,
            redirects=parse_std(redirects, nproc, "--redirects"),
            tee=parse_std(tee, nproc, "--tee"),
            local_ranks_filter=parse_local_ranks_filter(local_ranks_filter),
            signals_to_handle=parse_signals(signals_to_handle),
            virtual_local_rank=virtual_local_rank,
            timeouts=Timeouts(
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                progress_timeout=progress_timeout,
                shutdown_timeout=_shutdown_timeout(shutdown_timeout),
                recovery_timeout=recovery_timeout,
                startup_timeout=startup_timeout,
                node_lease=node_lease,
                node_timeout=node_timeout,
                join_timeout=_conf_seconds(conf, "join_timeout", JOIN_TIMEOUT_DEFAULT),
                connect_timeout=_conf_seconds(conf, "connect_timeout", CONNECT_TIMEOUT_DEFAULT),
            ),
            recovery=recovery_mode,
            max_recoveries=max_recoveries,
            startup_restarts=startup_restarts,
            verify_every=verify_every,
            exact_undo=exact_undo,
            transfer_chunk_mb=transfer_chunk_mb,
            log_budget=_size(log_budget, "--log-budget"),
            log_memory=_size(log_memory, "--log-memory"),
            stage_ckpt_dir=stage_ckpt_dir,
            parallel_replay=parallel_replay,
            spares=spares,
            dashboard=dashboard,
            event_log=event_log,
            faults=tuple(FaultSpec.parse(text) for text in fault or ()),
            python=python or "",
            external_coordinator=external_coordinator,
            control_port=int(_conf_seconds(conf, "control_port", 0)),
        )
        from swiftrun import launcher

        code = launcher.coordinate(config) if as_coordinator else launcher.launch(config)
    except SwiftrunError as err:
        _fail(err)
    raise typer.Exit(code)


def _size(flag: str | None, name: str) -> int | None:
    """A SIZE flag (2GiB, 500MB, 123) in bytes; bad text is a ConfigError naming the flag."""
    if flag is None:
        return None
    from swiftrun.logplan.planner import PlanError, parse_size

    try:
        return parse_size(flag)
    except PlanError as err:
        raise ConfigError(f"{name}: {err}") from None


def _conf_seconds(conf: tuple[tuple[str, str], ...], key: str, default: float) -> float:
    """A number from --rdzv-conf (``join_timeout=30``, ``control_port=29401``), else ``default``."""
    for name, value in conf:
        if name == key:
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"--rdzv-conf {key}={value!r} is not a number") from None
    return default


def _shutdown_timeout(flag: float | None) -> float:
    if flag is not None:
        return flag
    env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "").strip()
    if not env:
        return SHUTDOWN_TIMEOUT_DEFAULT
    try:
        return float(env)
    except ValueError:
        raise ConfigError(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env!r} is not a number of seconds") from None


_normalize.learn(typer.main.get_command(app))


# ``swiftrun NAME ...``: commands other than launching, each a module with ``main(argv) -> exit code``.
SUBCOMMANDS = {"report": "swiftrun.report", "plan": "swiftrun.cli.plan"}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: ``swiftrun [FLAGS] SCRIPT [ARGS...]``, ``swiftrun report|plan ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == COORDINATOR:
        # the launcher's own flags and rules (PET_*, Slurm defaults, abbreviations), a different ending
        command = typer.main.get_command(app)
        command.help = COORDINATOR_HELP
        command.main(args=args[1:], prog_name="swiftrun coordinator", obj=COORDINATOR)
        return
    if args and args[0] in SUBCOMMANDS:
        try:
            # import_module, not "from swiftrun import report": the package lazily exports a report() function
            code = importlib.import_module(SUBCOMMANDS[args[0]]).main(args[1:])
        except SwiftrunError as err:
            print(f"swiftrun: error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        sys.exit(code)
    app(args=args, prog_name="swiftrun")
