"""The typer app behind ``swiftrun``: every flag's declaration, spelling, env name and help, and nothing else.

``swiftrun train.py`` takes what ``torchrun train.py`` takes (``torch/distributed/run.py``): every flag in its
dashed and underscored spelling, every torchrun flag also read from ``PET_<NAME>`` (the command line wins), a
unique prefix of a long flag (argparse's ``allow_abbrev``), and everything from the script on handed to the
script untouched. swiftrun's own flags read ``SWIFTRUN_<NAME>``. torchrun flags that swiftrun does not implement
are accepted by the parser and then refused with an error naming them, never silently ignored.

The ``launch`` command packs what typer parsed into a :class:`~swiftrun.cli.resolve.Flags` and hands it to
:func:`~swiftrun.cli.resolve.build_config`, where every rule lives; a flag's default is written once, in
``Flags``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from swiftrun.cli.resolve import Flags, build_config
from swiftrun.errors import SwiftrunError

_D = Flags  # the defaults
_FLAG_NAMES = frozenset(Flags.names())

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
    ] = _D.nproc_per_node,
    nnodes: Annotated[
        str | None,
        _torchrun(
            "--nnodes", panel=WORKERS, metavar="N|MIN:MAX", show_default="1, or Slurm's node count",
            help="Training nodes; with MIN:MAX, MIN train and node ranks MIN..MAX-1 are hot spares.",
        ),
    ] = _D.nnodes,
    node_rank: Annotated[
        int | None,
        _torchrun(
            "--node-rank", panel=WORKERS, show_default="0, or $SLURM_NODEID",
            help="Rank of this node; >= --nnodes: a hot-spare node.",
        ),
    ] = _D.node_rank,
    spare_nodes: Annotated[
        int,
        _own("--spare-nodes", panel=WORKERS,
             help="Under Slurm: the last N nodes of the allocation are hot spares (--nnodes = nodes - N)."),
    ] = _D.spare_nodes,
    module: Annotated[
        bool, _torchrun("-m", "--module", panel=WORKERS, help="Run SCRIPT as a module, like python -m.")
    ] = _D.module,
    no_python: Annotated[
        bool, _torchrun("--no-python", panel=WORKERS, help="Execute SCRIPT directly, without python.")
    ] = _D.no_python,
    run_path: Annotated[
        bool, _torchrun("--run-path", panel=WORKERS, help="Run SCRIPT with runpy.run_path (wins over --no-python).")
    ] = _D.run_path,
    role: Annotated[
        str, _torchrun("--role", panel=WORKERS, help=r"Role name, shown in the \[role0]: log prefix.")
    ] = _D.role,
    virtual_local_rank: Annotated[
        bool,
        _torchrun(
            "--virtual-local-rank", panel=WORKERS,
            help="LOCAL_RANK=0 for all; each worker sees only its GPU.",
        ),
    ] = _D.virtual_local_rank,
    start_method: Annotated[
        str,
        _torchrun(
            "--start-method", panel=WORKERS, metavar="spawn|fork|forkserver",
            help="Accepted for torchrun compatibility (no effect on scripts).",
        ),
    ] = _D.start_method,
    python: Annotated[
        str | None,
        _own(
            "--python", panel=WORKERS, metavar="PATH", show_default="$PYTHON_EXEC or this python",
            help="Interpreter for workers.",
        ),
    ] = _D.python,
    # Rendezvous
    master_addr: Annotated[
        str, _torchrun("--master-addr", panel=RENDEZVOUS, help="Address of the store workers connect to.")
    ] = _D.master_addr,
    master_port: Annotated[
        int | None,
        _torchrun(
            "--master-port", panel=RENDEZVOUS, show_default="a free port",
            help="Port of the store.",
        ),
    ] = _D.master_port,
    rdzv_backend: Annotated[
        str | None,
        _torchrun(
            "--rdzv-backend", panel=RENDEZVOUS, metavar="static|c10d", show_default="static (c10d under Slurm)",
            help="Rendezvous backend.",
        ),
    ] = _D.rdzv_backend,
    rdzv_endpoint: Annotated[
        str,
        _torchrun(
            "--rdzv-endpoint", panel=RENDEZVOUS, metavar="HOST[:PORT]",
            help="Rendezvous endpoint (c10d default port 29400).",
        ),
    ] = _D.rdzv_endpoint,
    rdzv_id: Annotated[
        str | None,
        _torchrun("--rdzv-id", panel=RENDEZVOUS, show_default="none, or $SLURM_JOB_ID",
                  help="Job id (TORCHELASTIC_RUN_ID)."),
    ] = _D.rdzv_id,
    rdzv_conf: Annotated[
        str, _torchrun("--rdzv-conf", panel=RENDEZVOUS, metavar="K=V,...", help="Extra rendezvous settings.")
    ] = _D.rdzv_conf,
    standalone: Annotated[
        bool, _torchrun("--standalone", panel=RENDEZVOUS, help="Local c10d store on a free port, random id.")
    ] = _D.standalone,
    local_addr: Annotated[
        str | None, _torchrun("--local-addr", panel=RENDEZVOUS, help="Address this node advertises.")
    ] = _D.local_addr,
    external_coordinator: Annotated[
        bool,
        _own("--external-coordinator", panel=RENDEZVOUS,
             help="The store and control plane run as `swiftrun coordinator` at the endpoint, not in node 0."),
    ] = _D.external_coordinator,
    node_lease: Annotated[
        float,
        _own("--node-lease", panel=RENDEZVOUS, metavar="SECONDS",
             help="An agent that lost the coordinator this long kills its workers (fencing)."),
    ] = _D.node_lease,
    node_timeout: Annotated[
        float,
        _own("--node-timeout", panel=RENDEZVOUS, metavar="SECONDS",
             help="A node silent this long is lost and its slot handed out again (> --node-lease)."),
    ] = _D.node_timeout,
    # Restarts and recovery
    max_restarts: Annotated[
        int, _torchrun("--max-restarts", panel=RESTARTS, help="Whole-group restarts before failing.")
    ] = _D.max_restarts,
    monitor_interval: Annotated[
        float, _torchrun("--monitor-interval", panel=RESTARTS, metavar="SECONDS", help="Worker poll period.")
    ] = _D.monitor_interval,
    signals_to_handle: Annotated[
        str, _torchrun("--signals-to-handle", panel=RESTARTS, metavar="SIG,...", help="Signals forwarded to workers.")
    ] = _D.signals_to_handle,
    shutdown_timeout: Annotated[
        float | None,
        _torchrun(
            "--shutdown-timeout",
            panel=RESTARTS,
            metavar="SECONDS",
            show_default="$TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30",
            help="SIGTERM -> SIGKILL grace.",
        ),
    ] = _D.shutdown_timeout,
    # swiftrun's own recovery
    recovery: Annotated[
        str,
        _own(
            "--recovery", panel=SWIFT, metavar="auto|roll-forward|undo|restart",
            help="How a failed rank is repaired (restart: like torchrun).",
        ),
    ] = _D.recovery,
    max_recoveries: Annotated[
        int, _own("--max-recoveries", panel=SWIFT, help="In-place recoveries before failing.")
    ] = _D.max_recoveries,
    startup_restarts: Annotated[
        int,
        _own(
            "--startup-restarts", panel=SWIFT,
            help="Restarts of every worker after a signal or hang before all ranks reached swiftrun.Run "
                 "(not counted in --max-restarts).",
        ),
    ] = _D.startup_restarts,
    verify_every: Annotated[
        int,
        _own("--verify-every", panel=SWIFT, metavar="N",
             help="Also compare every rank's whole state every N steps (0: only after each recovery)."),
    ] = _D.verify_every,
    exact_undo: Annotated[
        bool | None,
        _own("--exact-undo/--no-exact-undo", panel=SWIFT, show_default="where the job may undo an update",
             help="Copy the parameters and optimizer state before every optimizer step, so that an undone update "
                  "is restored bitwise (costs their memory, in host memory on a GPU, and a copy per step). By "
                  "default only where the job may undo: a collective after optimizer.step() in the step, "
                  "DDP-broadcast buffers, pipelines, --recovery undo. --no-exact-undo saves the memory: an undo "
                  "then inverts the update arithmetically, not bitwise (1.5e-4 relative off measured on an AdamW "
                  "job), and the recovery says so."),
    ] = _D.exact_undo,
    transfer_chunk_mb: Annotated[
        int,
        _own("--transfer-chunk-mb", panel=SWIFT, metavar="MB",
             help="Chunk size of a recovery's state transfer (0: 16 on the CPU, 64 on a GPU)."),
    ] = _D.transfer_chunk_mb,
    log_budget: Annotated[
        str | None,
        _own("--log-budget", panel=SWIFT, metavar="SIZE",
             help="Pipelines: bytes of stage-boundary logs to keep (e.g. 2GiB); pipeline ranks (with all their "
                  "stages, also interleaved) are grouped to minimise the expected replay within it (default: log "
                  "every boundary)."),
    ] = _D.log_budget,
    log_memory: Annotated[
        str | None,
        _own("--log-memory", panel=SWIFT, metavar="SIZE",
             help="Pipelines: host memory a rank's boundary logs may use; older entries spill to local disk "
                  "(default 4GiB)."),
    ] = _D.log_memory,
    parallel_replay: Annotated[
        int | None,
        _own("--parallel-replay", panel=SWIFT, metavar="N",
             help="Pipelines: at most N idle survivors help replay each lost stage or logging group (in chains "
                  "of one helper per stage), each taking a contiguous range of its micro-batches (bitwise the same "
                  "result; default: every idle survivor; 0: replay alone)."),
    ] = _D.parallel_replay,
    stage_ckpt_dir: Annotated[
        Path | None,
        _own("--stage-ckpt-dir", panel=SWIFT, metavar="DIR",
             help="Pipelines: also write every stage checkpoint here (shared storage), so that adjacent stages "
                  "lost together can still be replayed."),
    ] = _D.stage_ckpt_dir,
    spares: Annotated[int, _own("--spares", panel=SWIFT, help="Warm spare workers kept ready to replace a rank.")] = _D.spares,
    heartbeat_interval: Annotated[
        float, _own("--heartbeat-interval", panel=SWIFT, metavar="SECONDS", help="Worker heartbeat period.")
    ] = _D.heartbeat_interval,
    heartbeat_timeout: Annotated[
        float, _own("--heartbeat-timeout", panel=SWIFT, metavar="SECONDS", help="Silence after which a worker is hung.")
    ] = _D.heartbeat_timeout,
    progress_timeout: Annotated[
        float,
        _own(
            "--progress-timeout", panel=SWIFT, metavar="SECONDS",
            help="No new step for this long is a stall (0: off).",
        ),
    ] = _D.progress_timeout,
    recovery_timeout: Annotated[
        float, _own("--recovery-timeout", panel=SWIFT, metavar="SECONDS", help="Deadline for one in-place recovery.")
    ] = _D.recovery_timeout,
    startup_timeout: Annotated[
        float,
        _own(
            "--startup-timeout", panel=SWIFT, metavar="SECONDS",
            help="Deadline of a worker's start: spawn to hello; a replacement's also to swiftrun.Run.",
        ),
    ] = _D.startup_timeout,
    # Logs
    log_dir: Annotated[
        Path | None, _torchrun("--log-dir", panel=LOGS, metavar="DIR", help="Base directory for per-rank logs.")
    ] = _D.log_dir,
    redirects: Annotated[
        str,
        _torchrun(
            "-r", "--redirects", panel=LOGS, metavar="0-3|LR:V,...",
            help="Send streams to files (1 out, 2 err, 3 both).",
        ),
    ] = _D.redirects,
    tee: Annotated[
        str, _torchrun("-t", "--tee", panel=LOGS, metavar="0-3|LR:V,...", help="Like -r, and also to the console.")
    ] = _D.tee,
    local_ranks_filter: Annotated[
        str,
        _torchrun(
            "--local-ranks-filter", panel=LOGS, metavar="LR,...",
            help="Show only these local ranks on the console.",
        ),
    ] = _D.local_ranks_filter,
    event_log: Annotated[
        Path | None,
        _own(
            "--event-log", panel=LOGS, metavar="PATH",
            help="Write a JSON-lines event log (read it with swiftrun report).",
        ),
    ] = _D.event_log,
    # Dashboard
    dashboard: Annotated[
        bool | None,
        _own(
            "--dashboard/--no-dashboard", panel=DASHBOARD, show_default="on a terminal",
            help="Live dashboard.",
        ),
    ] = _D.dashboard,
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
    ] = _D.logs_specs,
    numa_binding: Annotated[
        str | None, _torchrun("--numa-binding", env=False, hidden=True, help="Not implemented.")
    ] = _D.numa_binding,
    event_log_handler: Annotated[str, _torchrun("--event-log-handler", hidden=True, help="Only null.")] = _D.event_log_handler,
    duplicate_stdout_filters: Annotated[
        str, _torchrun("--duplicate-stdout-filters", hidden=True, help="Not implemented.")
    ] = _D.duplicate_stdout_filters,
    duplicate_stderr_filters: Annotated[
        str, _torchrun("--duplicate-stderr-filters", hidden=True, help="Not implemented.")
    ] = _D.duplicate_stderr_filters,
) -> None:
    """Launch SCRIPT on local workers exactly like torchrun, and recover failed ranks in place."""
    as_coordinator = ctx.obj == COORDINATOR
    given = {name: value for name, value in locals().items() if name in _FLAG_NAMES}
    flags = Flags(**{**given, "script_args": tuple(script_args or ()), "fault": tuple(fault or ())})
    try:
        config = build_config(flags, os.environ, coordinator=as_coordinator)
        from swiftrun import launcher

        code = launcher.coordinate(config) if as_coordinator else launcher.launch(config)
    except SwiftrunError as err:
        _fail(err)
    raise typer.Exit(code)


_normalize.learn(typer.main.get_command(app))
