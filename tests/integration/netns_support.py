"""Network partitions on one machine: hosts in network namespaces of their own, joined by a bridge.

A *switch* is a bridge in a user + network namespace of its own (``unshare -rn``: no root needed where the kernel
allows unprivileged user namespaces). Each *host* is a network namespace nested in it, with lo and one veth whose
other end is a port of the bridge; its processes (a node's agent and its workers, or a coordinator) are started
in it with ``nsenter``, so they are ordinary children of the test: same file system, same pids, same marker
variable, the same teardown leak check as every other test.

Cutting a host detaches its veth from the bridge. Both ends keep their carrier and their addresses: packets
simply go nowhere, no FIN, no RST, no ICMP, no error a socket could see (a switch port or a cable failing away
from the host). The host's processes keep running, which is what SIGSTOP cannot show: an agent that keeps
thinking, finds its lease expired and fences itself while cut off. Healing re-attaches the port; TCP's
retransmissions then deliver whatever the host's sockets still had to say. (tc/netem and iptables are absent on
the machines this was written on; neither is needed.)
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import test_env, wait_until

SUBNET = "10.77.0"  # a /24 private to the switch: nothing outside the namespaces can see it
BRIDGE = "br0"
IFNAME = "eth0"  # every host's one interface (GLOO_SOCKET_IFNAME): gloo must not advertise an address by hostname
SETUP_TIMEOUT = 10.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (no unprivileged user namespaces, no veth, no ``nsenter``...)."""


@dataclass(frozen=True)
class Host:
    name: str
    addr: str  # its address on the switch
    pid: int  # the process holding its network namespace
    port: str  # its veth end in the switch's namespace (a port of the bridge)


class Switch:
    """A bridge and the hosts on it. ``close`` ends every holder; the namespaces go with their last process."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self._holders: list[subprocess.Popen] = []
        self.hosts: dict[str, Host] = {}
        self._next = 10
        try:
            self.pid = self._hold(["unshare", "-rn"])
            self.sh(f"ip link set lo up && ip link add {BRIDGE} type bridge && ip link set {BRIDGE} up")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ namespaces

    def _hold(self, prefix: list[str]) -> int:
        """A process that sits in a fresh namespace until we close its stdin (or the test process dies: its
        pipe closes then too, so a crashed test leaves no holder behind)."""
        proc = subprocess.Popen([*prefix, "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=test_env(self.marker), start_new_session=True)
        self._holders.append(proc)

        def ready() -> bool:
            if proc.poll() is not None:
                raise NetnsUnavailable(f"{' '.join(prefix)}: {proc.stderr.read().decode().strip() or proc.returncode}")
            try:  # `cat` runs once unshare/nsenter set the namespace up and exec'd it
                return Path(f"/proc/{proc.pid}/comm").read_text().strip() == "cat"
            except OSError:
                return False

        wait_until(ready, timeout=SETUP_TIMEOUT, what=f"{' '.join(prefix)} to hold a namespace")
        return proc.pid

    def enter(self, pid: int) -> list[str]:
        """The command prefix that runs a program in the namespaces of ``pid`` (the switch's user namespace, its
        root mapped to the caller's uid, so files it writes are the caller's)."""
        return ["nsenter", "-t", str(pid), "-U", "-n", "--"]

    def sh(self, script: str, pid: int | None = None) -> None:
        """Run a shell snippet in the switch's namespace (or in ``pid``'s); fail loudly."""
        proc = subprocess.run([*self.enter(pid or self.pid), "sh", "-ec", script], capture_output=True, text=True,
                              timeout=SETUP_TIMEOUT, env=test_env(self.marker))
        if proc.returncode != 0:
            raise NetnsUnavailable(f"{script!r} failed: {proc.stderr.strip() or proc.returncode}")

    # ------------------------------------------------------------------ hosts

    def host(self, name: str) -> Host:
        """A new host on the switch: a network namespace with lo and eth0 (address 10.77.0.N, N from 10 up)."""
        assert name not in self.hosts, name
        holder = self._hold([*self.enter(self.pid), "unshare", "-n"])
        addr, port = f"{SUBNET}.{self._next}", f"v{self._next}"
        self._next += 1
        self.sh(f"ip link add {port} type veth peer name {IFNAME} netns {holder} && "
                f"ip link set {port} master {BRIDGE} && ip link set {port} up")
        self.sh(f"ip link set lo up && ip addr add {addr}/24 dev {IFNAME} && ip link set {IFNAME} up", pid=holder)
        self.hosts[name] = host = Host(name, addr, holder, port)
        return host

    def cut(self, *hosts: Host) -> None:
        """Partition ``hosts`` from every other host (and from each other), at the same instant: their ports
        leave the bridge (carrier stays up on both ends)."""
        self.sh(" && ".join(f"ip link set {h.port} nomaster" for h in hosts))

    def heal(self, *hosts: Host) -> None:
        self.sh(" && ".join(f"ip link set {h.port} master {BRIDGE}" for h in hosts))

    def command(self, host: Host, cmd: list[str]) -> list[str]:
        """``cmd`` run on ``host`` (exec'd by nsenter: the returned command's process *is* the program)."""
        return [*self.enter(host.pid), *cmd]

    def env(self) -> dict[str, str]:
        """What a process on a host needs besides its marker: gloo binds and advertises eth0's address (by
        default it resolves the machine's hostname, an address that does not exist in the namespace, and falls
        back to loopback: peers on other hosts would then dial their own loopback)."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}

    def close(self) -> None:
        for proc in self._holders:
            if proc.stdin is not None:
                proc.stdin.close()
        deadline = time.monotonic() + 5.0
        for proc in self._holders:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        self._holders.clear()


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot run the partition tests (None: it can). Probed once per test session: a switch
    with one host, which needs unprivileged user namespaces, bridges, veths and nsenter."""
    switch = None
    try:
        switch = Switch(marker=f"netns-probe-{os.getpid()}")
        switch.host("probe")
        return None
    except (NetnsUnavailable, OSError, subprocess.SubprocessError, AssertionError) as exc:
        return f"network namespaces unavailable here ({exc})"
    finally:
        if switch is not None:
            switch.close()
