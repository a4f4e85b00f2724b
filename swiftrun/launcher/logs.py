"""Worker output: straight to the terminal as torchrun does, or relayed with prefixes and copied to files.

Without ``--redirects``, ``--tee`` or the dashboard, workers inherit the launcher's stdout and stderr, exactly as
under torchrun (a progress bar still sees a terminal). Otherwise every worker writes into pipes and one pump
thread relays complete lines: to ``<log dir>/attempt_<n>/<local_rank>/{stdout,stderr}.log`` when redirected,
and to the console with torchrun's ``[<role><local_rank>]:`` prefix when teed or shown on the dashboard.
The pump owns only pipe descriptors, never a ZeroMQ socket, so heavy output cannot delay the control loop.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from swiftrun.config import LaunchConfig, Std

ConsoleWriter = Callable[[str, bool], None]  # (line without newline, is_stderr)


@dataclass
class _Route:
    """Where the lines of one pipe go; changed in place when a spare becomes a rank."""

    prefix: str
    to_console: bool
    file: IO[bytes] | None
    partial: bytes = b""


class OutputPlan:
    """Decides, per local rank, how a worker's stdout and stderr are wired."""

    def __init__(self, config: LaunchConfig, relay_console: bool) -> None:
        self.config = config
        self.relay_console = relay_console  # the dashboard wants output above its live region
        self.piped = relay_console or any(config.redirects) or any(config.tee)

    def prefix(self, local_rank: int | None) -> str:
        return f"[{self.config.role}{'spare' if local_rank is None else local_rank}]:"

    def console_wanted(self, local_rank: int | None, stream: Std) -> bool:
        if local_rank is None:
            return True  # a spare's output (before it has a rank) only appears if something is wrong
        if not self.config.shows_on_console(local_rank):
            return False
        redirected = self.config.std_redirect(local_rank) & stream
        teed = self.config.std_tee(local_rank) & stream
        return bool(teed) or not redirected

    def file_wanted(self, local_rank: int | None, stream: Std) -> bool:
        if local_rank is None:
            return False
        return bool((self.config.std_redirect(local_rank) | self.config.std_tee(local_rank)) & stream)

    def inherit_target(self, local_rank: int | None) -> int | None:
        """For unpiped workers: None inherits the terminal, DEVNULL hides a filtered-out rank."""
        if local_rank is not None and not self.config.shows_on_console(local_rank):
            return subprocess.DEVNULL
        return None


class LogPump:
    """Relays piped worker output line by line on its own thread."""

    def __init__(self, plan: OutputPlan, console: ConsoleWriter) -> None:
        self.plan = plan
        self.console = console
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._routes: dict[int, _Route] = {}  # fd -> route
        self._slot_fds: dict[int, list[tuple[int, Std]]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="swiftrun-logs", daemon=True)
        self._thread.start()

    def add(self, slot_id: int, local_rank: int | None, stdout: IO[bytes] | None, stderr: IO[bytes] | None,
            attempt_dir: Path | None) -> None:
        with self._lock:
            for pipe, stream in ((stdout, Std.OUT), (stderr, Std.ERR)):
                if pipe is None:
                    continue
                fd = pipe.fileno()
                os.set_blocking(fd, False)
                route = _Route("", False, None)
                self._routes[fd] = route
                self._slot_fds.setdefault(slot_id, []).append((fd, stream))
                self._configure(route, local_rank, stream, attempt_dir)
                self._selector.register(fd, selectors.EVENT_READ, (pipe, stream))
        os.write(self._wake_w, b"x")

    def relabel(self, slot_id: int, local_rank: int, attempt_dir: Path | None) -> None:
        """A spare became ``local_rank``: its further output goes where that rank's output goes."""
        with self._lock:
            for fd, stream in self._slot_fds.get(slot_id, []):
                route = self._routes.get(fd)
                if route is not None:
                    self._configure(route, local_rank, stream, attempt_dir)

    def _configure(self, route: _Route, local_rank: int | None, stream: Std, attempt_dir: Path | None) -> None:
        route.prefix = self.plan.prefix(local_rank)
        route.to_console = self.plan.console_wanted(local_rank, stream)
        if route.file is not None:
            route.file.close()
            route.file = None
        if attempt_dir is not None and self.plan.file_wanted(local_rank, stream):
            path = attempt_dir / str(local_rank) / ("stdout.log" if stream is Std.OUT else "stderr.log")
            path.parent.mkdir(parents=True, exist_ok=True)
            route.file = path.open("ab")

    def close(self) -> None:
        """Drain what is left and stop the thread (call after every worker exited)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        with self._lock:
            for route in self._routes.values():
                if route.file is not None:
                    route.file.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            events = self._selector.select(timeout=0.5)
            for key, _ in events:
                if key.fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                self._pump(key.fd, final=False)
            if self._stop.is_set():
                with self._lock:
                    fds = [fd for fd in self._routes if fd in self._selector.get_map()]
                for fd in fds:
                    self._pump(fd, final=True)
                return

    def _pump(self, fd: int, final: bool) -> None:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                if final:
                    chunk = b""
                else:
                    return
            except OSError:
                chunk = b""
            with self._lock:
                route = self._routes.get(fd)
                if route is None:
                    return
                if not chunk:  # EOF
                    if route.partial:
                        self._emit(route, route.partial, fd)
                        route.partial = b""
                    try:
                        self._selector.unregister(fd)
                    except (KeyError, ValueError):
                        pass
                    return
                data = route.partial + chunk
                *lines, route.partial = data.split(b"\n")
                for line in lines:
                    self._emit(route, line, fd)

    def _emit(self, route: _Route, line: bytes, fd: int) -> None:
        if route.file is not None:
            route.file.write(line + b"\n")
            route.file.flush()
        if route.to_console:
            _, stream = self._selector.get_map()[fd].data if fd in self._selector.get_map() else (None, Std.OUT)
            self.console(f"{route.prefix}{line.decode(errors='replace')}", stream is Std.ERR)


def stdio_writer(line: str, is_stderr: bool) -> None:
    """The plain console writer: like torchrun's tee, prefixed lines on the launcher's own streams."""
    stream = sys.stderr if is_stderr else sys.stdout
    stream.write(line + "\n")
    stream.flush()
