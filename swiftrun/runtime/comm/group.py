"""The default process group of a recoverable worker: built per generation, aborted from the link thread.

Facts this design rests on (measured on torch 2.13, gloo, CPU; see docs/ARCHITECTURE.md):

- ``ProcessGroup.abort()`` does **not** release a gloo collective that waits on a peer that died without being
  its ring neighbour: that rank waits for the full group timeout. What does release it at once is shutting down
  the group's TCP connections: gloo's pair sees "Connection closed" and fails the pending operation, and every
  collective issued on that group afterwards fails immediately instead of hanging.
- Except, rarely, a *send*: a ring all-reduce was seen blocked in gloo's ``UnboundBuffer::waitSend`` after its
  connections were shut down (gdb, session 4's "deaf survivor"), bounded only by the collective timeout; a send
  pending before the shutdown, or posted after it, is released (measured), so it is a race inside gloo. The
  training thread therefore waits on gloo through futures the abort fails itself, and a group with such an
  operation still inside gloo is kept, never destroyed (runtime/comm/abortable.py).
- Shutting down gloo's *listening* socket kills the process (an enforce in gloo's listener thread), so only
  connected sockets are touched.

So the manager records which TCP connections the group's construction opened (descriptor and inode, since a
number may be reused later) and shuts exactly those down on abort. For NCCL, ``abort()`` aborts the
communicators, which is the documented way to release a blocked NCCL collective.
"""

from __future__ import annotations

import inspect
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from swiftrun.runtime.comm import abortable

from swiftrun.runtime.comm import subgroups

STORE_PREFIX = "/swiftrun/g{generation}/"


def _connected_tcp_sockets() -> dict[int, int]:
    """fd -> inode of this process's connected TCP sockets (listening ones excluded)."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            if (st.st_mode & 0o170000) != 0o140000:  # not a socket
                continue
            probe = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                probe.family in (socket.AF_INET, socket.AF_INET6)
                and probe.type == socket.SOCK_STREAM
                and not probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                found[fd] = st.st_ino
        except OSError:
            pass
        finally:
            probe.close()
    return found


class GroupManager:
    """Owns the default process group of this worker across generations."""

    def __init__(self, rank: int, world_size: int, backend: Any, timeout: timedelta | None, device_id: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout or timedelta(minutes=30)
        self.device_id = device_id
        self._lock = threading.Lock()
        self._sockets: list[tuple[int, int]] = []
        self._sockets_gen = -1  # the generation whose group (being) built opened _sockets
        self._aborted_below = 0  # groups of a generation below this one have been aborted
        self.generation = -1
        self._store: dist.Store | None = None
        self.connect_timeout = 30.0  # seconds a group's construction may take (the latest build's)

    def _connect_store(self) -> dist.Store:
        """A store client of this generation's own. Building the group waits in the store for every peer's
        address; a peer that died before it published its own would hold that wait for the whole connect timeout
        (30 s measured, fault campaign). The client's connection is aborted with the generation's group, which
        releases the wait at once (a shut-down store connection fails the pending get: measured, torch 2.13)."""
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._store = dist.TCPStore(addr, port, self.world_size, is_master=False, timeout=timedelta(seconds=60))
        return self._store

    def build(self, generation: int, connect_timeout: float) -> None:
        """Replace the default group by a fresh one for ``generation`` (a collective over every rank)."""
        with self._lock:
            if generation < self._aborted_below:
                raise RuntimeError(f"generation {generation} was aborted before its group was built")
        self._keep_if_blocked()
        self.destroy()
        # torch names the default group after a counter that only destroy_process_group() resets; a build that
        # failed (a peer died before it connected: the store wait timed out) took name "0" without a group to
        # destroy, so this rank's next group would be "1" while a replacement's is "0": each would wait for the
        # other's keys in the store until the connect timeout (fault campaign, a kill right after start-up)
        if hasattr(dist.distributed_c10d, "_world"):
            dist.distributed_c10d._world.group_count = 0
        self.connect_timeout = connect_timeout
        before = _connected_tcp_sockets()
        store = self._connect_store()
        with self._lock:  # an abort from now on releases the store wait too
            self._sockets = [(fd, ino) for fd, ino in _connected_tcp_sockets().items() if before.get(fd) != ino]
            self._sockets_gen = generation
            aborted = generation < self._aborted_below
        if aborted:
            raise RuntimeError(f"generation {generation} was aborted before its group was built")
        prefixed = dist.PrefixStore(STORE_PREFIX.format(generation=generation), store)
        kwargs: dict[str, Any] = {}
        if self.device_id is not None:
            kwargs["device_id"] = self.device_id
        # a peer that dies while the mesh connects must not hold us for the whole collective timeout
        dist.init_process_group(
            self.backend, store=prefixed, rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=connect_timeout), **kwargs,
        )
        pg = dist.group.WORLD
        if hasattr(pg, "set_timeout"):
            pg.set_timeout(self.timeout)
        # the script's own subgroups died with the old default group: the same ones again, same order everywhere
        subgroups.recreate(self._bounded)
        after = _connected_tcp_sockets()
        with self._lock:
            self._sockets = [(fd, ino) for fd, ino in after.items() if before.get(fd) != ino]
            self.generation = generation
            aborted = generation < self._aborted_below
        abortable.PENDING.open(generation)
        if aborted:  # the launcher moved past this generation while we were building it
            self.abort(self._aborted_below)

    def new_group(self, members: list[int]) -> Any:
        """A subgroup of the current generation whose connections are aborted with the rest (a transfer's
        source dying mid-stream must release its receivers at once, like any other collective)."""
        before = _connected_tcp_sockets()
        group = self._bounded(dist.new_group, (members,), {})
        after = _connected_tcp_sockets()
        with self._lock:
            self._sockets += [(fd, ino) for fd, ino in after.items() if before.get(fd) != ino]
            aborted = self.generation < self._aborted_below
        if aborted:
            self.abort(self._aborted_below)
        return group

    def _bounded(self, new_group: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``new_group(*args, **kwargs)`` whose construction waits at most the connect timeout, then with the
        collective timeout it asked for (torch's default when none: 30 min for gloo).

        A group's construction connects a full mesh with the group's timeout. A member that published its
        address and died before connecting (a rank killed right after START, fault campaign) left every other
        member waiting in gloo's connect for that whole timeout, 30 minutes, deaf to the launcher's ABORT: the
        abort shuts down only connections that exist, and these were still being made. Bounded like the
        default group's (``init_process_group(timeout=connect_timeout)``), the construction fails within the
        connect timeout and the rank answers the abort."""
        bound = inspect.signature(new_group).bind(*args, **kwargs)
        wanted = bound.arguments.get("timeout")
        bound.arguments["timeout"] = timedelta(seconds=self.connect_timeout)
        group = new_group(*bound.args, **bound.kwargs)
        if isinstance(group, dist.ProcessGroup) and hasattr(group, "set_timeout"):
            group.set_timeout(wanted if wanted is not None else _default_timeout(self.backend))
        return group

    def abort(self, generation: int) -> None:
        """Generation ``generation`` begins: release every collective blocked on an older group, now.

        Safe from any thread, idempotent. The launcher repeats an ABORT a rank has not answered (a lost message,
        launcher/job.py RESEND_INTERVAL), and a repeat may arrive while this rank already builds the group of that
        very generation (a replacement builds it without waiting for any ABORT): only the sockets of an older
        generation's group are shut down."""
        abortable.PENDING.abort(generation)  # the training thread's waits end now, whatever gloo does
        with self._lock:
            self._aborted_below = max(self._aborted_below, generation)
            stale = self._sockets_gen < generation
            sockets = list(self._sockets) if stale else []
            groups = list(dist.distributed_c10d._world.pg_map) if stale and dist.is_initialized() else []
        for fd, ino in sockets:
            try:
                if os.fstat(fd).st_ino != ino:
                    continue  # the descriptor was closed and its number reused: not ours any more
                conn = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                conn.close()
        _abort_nccl([pg for pg in groups if _has_nccl(pg)])

    def _keep_if_blocked(self) -> None:
        """Before the old generation's groups are dropped: if one of its operations is still inside gloo, keep
        every group of that generation alive (destroying one joins its blocked worker thread)."""
        if self.generation < 0 or not abortable.PENDING.blocked(self.generation):
            return
        groups = list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []
        if abortable.keep_forever(groups):
            from swiftrun.runtime.worker.process import warn

            warn(f"a collective of generation {self.generation} is still blocked inside gloo after the abort; "
                 f"its {len(groups)} process group(s) are kept (never destroyed) so that this rank goes on")

    def destroy(self) -> None:
        """Drop the current default group (aborted or a placeholder) so a new one can be initialised."""
        with self._lock:
            self._sockets = []
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - an aborted group may complain while being torn down
                dist.distributed_c10d._world.pg_map.clear()
                dist.distributed_c10d._update_default_pg(None)

    def device(self) -> torch.device:
        """Where this group's collectives want their tensors."""
        if _backend_name(self.backend) == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _abort_nccl(groups: list[Any], wait: float = 10.0) -> None:
    """Abort every NCCL communicator of the generation at once, each in a thread of its own: one
    ``ncclCommAbort`` can block until its kernels drain, and a mesh has a group per dimension (FSDP2/HSDP: the
    shard, replicate and reduce-scatter groups besides the default one), which aborted in turn would add up. An
    abort that fails or does not return within ``wait`` leaves the watchdog and the timeouts as the backstop."""
    def abort(pg: Any) -> None:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - see above
            pass

    threads = [threading.Thread(target=abort, args=(pg,), name="swiftrun-nccl-abort", daemon=True) for pg in groups]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + wait
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


def _default_timeout(backend: Any) -> timedelta:
    """What torch gives a group created without a timeout."""
    try:
        return dist.distributed_c10d._get_default_timeout(dist.Backend(_backend_name(backend)))
    except Exception:  # noqa: BLE001 - a private helper: fall back to its documented value
        return timedelta(minutes=30)


def _backend_name(backend: Any) -> str:
    return str(backend or "gloo").lower()


def _has_nccl(pg: Any) -> bool:
    try:
        return "nccl" in str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001
        return False
