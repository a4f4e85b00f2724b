"""How every Python worker starts: ``python -u -m swiftrun.runtime.bootstrap {script|module} TARGET ARGS...``.

1. Ask the kernel to SIGKILL this process when the launcher dies, and exit if it already has.
2. A warm spare imports torch (or was forked from the zygote with torch imported) and waits for the launcher to
   give it a rank.
3. Connect the control link (heartbeats start before the user's first import).
4. A replacement that joins survivors gets a placeholder process group until swiftrun.Run joins it for real.
5. Run the target exactly as ``python script.py`` / ``python -m module`` would (``__main__``, ``sys.argv``,
   ``sys.path[0]``); an uncaught exception is printed as Python prints it, written to TORCHELASTIC_ERROR_FILE
   (torch's ``@record`` format) and sent to the launcher, and the process exits with status 1.
"""

from __future__ import annotations

import logging
import os
import runpy
import signal
import sys
import traceback
import types
from types import TracebackType

from swiftrun.protocol.control import CommandKind, EventKind
from swiftrun.runtime.worker import process
from swiftrun.runtime.worker.env import WorkerEnv, settings
from swiftrun.runtime.worker.link import Link

PR_SET_PDEATHSIG = 1
log = logging.getLogger("swiftrun.runtime")


def _die_with_parent(launcher_pid: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the link thread's parent check still ends an orphan within a heartbeat
    if launcher_pid and os.getppid() != launcher_pid:
        os._exit(70)  # the launcher died before we could ask


def _warm_torch() -> None:
    """Pay, before any failure, what a replacement would pay after it: importing torch (~1.2 s here) and the
    ~800 modules DDP's constructor imports on first use (~1.2 s more, measured on torch 2.13)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    fake = dist.group.WORLD
    try:
        DistributedDataParallel(torch.nn.Linear(2, 2))
    finally:
        dist.destroy_process_group()
        forget_group(fake)


def forget_group(group: object) -> int:
    """Unbind ``group`` from every module imported while it was the default group; returns how many bindings.

    A module can capture the default group when it is imported: ``torch.distributed.nn.functional`` writes
    ``group=group.WORLD`` as its functions' default arguments, evaluated then. Imported during the warm-up, they
    would run every later call on the warm-up's fake group (a replacement's all-reduce returning its local values,
    its all_gather failing with "not initialized in the world group map"). A cold process imports such a module
    before ``init_process_group`` and binds None, which means "the default group at call time": the warm process
    is made to hold exactly that. Found by identity in module globals, functions' defaults and the functions of
    module-level classes (where torch keeps such defaults); nothing is imported or evaluated on the way.
    """
    forgotten = 0

    def unbind(fn: object) -> None:
        nonlocal forgotten
        if type(fn) is not types.FunctionType:  # exact type: no __instancecheck__ of torch's opaque classes runs
            return
        defaults = fn.__defaults__
        if defaults and any(d is group for d in defaults):
            fn.__defaults__ = tuple(None if d is group else d for d in defaults)
            forgotten += 1
        kwdefaults = fn.__kwdefaults__
        if kwdefaults and any(d is group for d in kwdefaults.values()):
            fn.__kwdefaults__ = {k: None if d is group else d for k, d in kwdefaults.items()}
            forgotten += 1

    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is group:
                namespace[name] = None
                forgotten += 1
            elif type(value) is types.FunctionType:
                unbind(value)
            elif type(value) is type and value.__module__ == namespace.get("__name__"):
                for member in list(vars(value).values()):
                    unbind(getattr(member, "__func__", member))  # plain, class and static methods
    return forgotten


def _set_idle_priority(native_thread_id: int, idle: bool) -> None:
    """Run a thread at SCHED_IDLE (it only gets CPU nobody else wants) or back at SCHED_OTHER.

    A spare warms up while the job trains; on a machine whose cores the workers already fill, a warm-up at
    normal priority slows every step (measured here: 4 ranks on 2 cores, 14.6 -> 20.2 ms per step)."""
    policy = getattr(os, "SCHED_IDLE", None) if idle else getattr(os, "SCHED_OTHER", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    try:
        os.sched_setscheduler(native_thread_id, policy, os.sched_param(0))
    except OSError:
        pass  # not permitted here: warm up at normal priority


def _wait_for_rank(link: Link, warm: bool = False) -> None:
    """A spare: warm the expensive imports (unless forked warm from the zygote), then block until ASSIGN gives
    this process a rank.

    The warm-up runs in its own thread at SCHED_IDLE and the main thread stays at SCHED_OTHER: an unprivileged
    process cannot go back from SCHED_IDLE to SCHED_OTHER (EPERM under RLIMIT_NICE 0, checked as uid 65534), so
    lowering the main thread would leave the replacement running the user's script at idle priority for good.
    """
    import threading

    warmer = None
    if not warm:
        def warm_up() -> None:
            # Spares start with the job and are replenished while it trains: warming up must never slow the
            # workers (their imports at start-up, their steps later).
            _set_idle_priority(threading.get_native_id(), idle=True)
            try:
                _warm_torch()
            except Exception:  # noqa: BLE001 - warming is an optimisation; a cold start still works
                log.debug("warming the spare failed", exc_info=True)
            log.debug("spare warm, waiting for a rank")

        warmer = threading.Thread(target=warm_up, name="swiftrun-warm", daemon=True)
        warmer.start()
        # a rank is needed now: let the rest of the warm-up run at full speed where the OS allows it (root)
        link.on_assign = lambda: _set_idle_priority(warmer.native_id or 0, idle=False) if warmer.is_alive() else None
    link.wait_for(lambda: link.command(CommandKind.ASSIGN) is not None or link.command(CommandKind.SHUTDOWN) is not None)
    if link.command(CommandKind.SHUTDOWN) is not None:
        link.close()
        os._exit(0)
    if warmer is not None and warmer.is_alive():
        _set_idle_priority(warmer.native_id or 0, idle=False)
        # the script imports the same modules: Python's per-module import locks make it wait for the warm-up of a
        # module already under way rather than import it twice; joining keeps the order simple
        warmer.join()
    assign = link.command(CommandKind.ASSIGN)
    assert assign is not None
    os.environ.update({k: str(v) for k, v in assign.args["env"].items()})
    _apply_thread_count()
    link.rank = int(assign.args["rank"])


def _apply_thread_count() -> None:
    """torch sized its thread pool when it was imported (a spare, a zygote's child): follow OMP_NUM_THREADS now."""
    torch = sys.modules.get("torch")
    value = os.environ.get("OMP_NUM_THREADS", "")
    if torch is None or not value:
        return
    try:
        n = int(value)
    except ValueError:
        return
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _placeholder_process_group(runtime: process.ProcessRuntime) -> None:
    """Make the replacement's own ``init_process_group`` create a fake group with the right rank and size.

    Survivors are not running the script's set-up, so a real group would wait for them forever and every
    collective of the set-up (DDP's parameter broadcast, a barrier) would hang. With the fake group the set-up
    runs alone; swiftrun.Run then joins the survivors' new generation and receives the real state.
    """
    import torch.distributed as dist

    real_init = dist.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None, **kwargs):
        runtime.init_kwargs = {"backend": backend, "timeout": timeout, "device_id": device_id}
        from torch.testing._internal.distributed.fake_pg import FakeStore

        rank = int(os.environ["RANK"]) if rank in (-1, None) else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size in (-1, None) else world_size
        real_init("fake", store=FakeStore(), rank=rank, world_size=world_size)
        dist.init_process_group = real_init  # one placeholder only
        dist.distributed_c10d.init_process_group = real_init
        _own_objects_on_the_placeholder()

    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


def _own_objects_on_the_placeholder() -> None:
    """Object collectives on the fake group keep this rank's own objects.

    The fake group leaves a receiving tensor as it was allocated, and ``broadcast_object_list`` sizes its buffer
    from a received length: uninitialised memory, so a set-up that broadcasts an object (Lightning broadcasts its
    log directory before the strategy's set-up) asked for exabytes and died. What the set-up would have received
    is replaced by the real state when swiftrun.Run joins anyway."""
    import torch.distributed as dist

    def on_placeholder(group: object) -> bool:
        try:
            return dist.get_backend(group) == "fake"
        except (RuntimeError, ValueError):
            return False

    real_broadcast, real_gather = dist.broadcast_object_list, dist.all_gather_object

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        if on_placeholder(group):
            return None
        return real_broadcast(object_list, src=src, group=group, device=device, group_src=group_src)

    def all_gather_object(object_list, obj, group=None):
        if on_placeholder(group):
            object_list[:] = [obj] * len(object_list)
            return None
        return real_gather(object_list, obj, group=group)

    for module in (dist, dist.distributed_c10d):
        module.broadcast_object_list = broadcast_object_list
        module.all_gather_object = all_gather_object


def _user_traceback(exc: BaseException, target: str) -> str:
    """The traceback as ``python script.py`` would print it: starting at the first frame of the user's code."""
    tb: TracebackType | None = exc.__traceback__
    here = os.path.dirname(os.path.abspath(__file__))
    while tb is not None:
        filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not filename.startswith(here) and "runpy" not in os.path.basename(filename):
            break
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _report_failure(link: Link | None, exc: BaseException, target: str) -> None:
    text = _user_traceback(exc, target)
    sys.stderr.write(text)
    sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            from swiftrun.protocol.errorfile import write_error_file

            write_error_file(error_file, type(exc).__name__, str(exc), text)
        except OSError:
            pass
    if link is not None:
        link.send_event(EventKind.FAILED, traceback=text)
        link.close()


def run_target(mode: str, target: str, args: list[str]) -> None:
    """Run the user's target as python itself would, in this interpreter."""
    if mode == "module":
        sys.argv = [target, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: list[str], warm: bool = False) -> None:
    """``warm``: this process was forked from the zygote with torch already imported (swiftrun/runtime/zygote.py)."""
    if len(argv) < 2 or argv[0] not in ("script", "module"):
        sys.stderr.write("usage: python -m swiftrun.runtime.bootstrap {script|module} TARGET [ARGS...]\n")
        sys.exit(2)
    mode, target, args = argv[0], argv[1], argv[2:]
    loglevel = settings().loglevel
    if loglevel:
        logging.basicConfig(level=loglevel.upper(),
                            format="%(relativeCreated)8.0fms swiftrun[%(process)d] %(message)s")
    wenv = WorkerEnv.read()
    _die_with_parent(wenv.launcher_pid)
    if warm:
        _apply_thread_count()
    link = None
    if wenv.ctl_addr:
        link = Link(wenv)
        if wenv.spare:
            _wait_for_rank(link, warm=warm)
            log.debug("spare assigned rank %s", os.environ.get("RANK"))
            wenv = WorkerEnv.read()
            link.wenv = wenv
        runtime = process.ProcessRuntime(wenv=wenv, link=link)
        process.install(runtime)
        if wenv.joining:
            _placeholder_process_group(runtime)
        from swiftrun.runtime.comm import subgroups

        subgroups.install()  # the script's dist.new_group calls, recorded to be re-created after a recovery
    from swiftrun.runtime.worker import faults

    faults.install(wenv)
    faults.before_failure = link.flush if link is not None else None
    log.debug("running %s %s", mode, target)
    try:
        run_target(mode, target, args)
    except SystemExit as exc:
        _leave(link)
        _exit_if_groups_kept(exc.code)
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - the user's error, reported as python would, then exit 1
        _report_failure(link, exc, target)
        _exit_if_groups_kept(1)
        sys.exit(1)
    _leave(link)
    _exit_if_groups_kept(0)


def _exit_if_groups_kept(code: object) -> None:
    """A recovery kept a process group whose operation was blocked inside gloo (runtime/comm/abortable.py): the
    interpreter's finalization must not run while it may wake."""
    kept = sys.modules.get("swiftrun.runtime.comm.abortable")
    if kept is not None:
        kept.exit_if_kept(code)


def _leave(link: Link | None) -> None:
    """The script returned: say so before the heartbeats stop, since torch's own exit (process groups, threads,
    atexit handlers) can take seconds and must not look like a hang to the launcher."""
    if link is not None:
        link.send_event(EventKind.EXITING)
        link.close()


if __name__ == "__main__":
    main(sys.argv[1:])
