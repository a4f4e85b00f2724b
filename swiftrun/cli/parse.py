"""Single flag values: text as typed (or read from ``PET_*``/``SWIFTRUN_*``) in, a typed value out.

Each function takes one flag's text and returns what :class:`~swiftrun.config.LaunchConfig` holds, or raises a
:class:`~swiftrun.errors.ConfigError` naming the flag. Nothing here reads the environment or imports typer; the
rules that relate flags to one another are in :mod:`swiftrun.cli.resolve`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from swiftrun.config import Std
from swiftrun.errors import ConfigError

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


def parse_size_flag(flag: str | None, name: str) -> int | None:
    """A SIZE flag (2GiB, 500MB, 123) in bytes; bad text is a ConfigError naming the flag."""
    if flag is None:
        return None
    from swiftrun.logplan.planner import PlanError, parse_size

    try:
        return parse_size(flag)
    except PlanError as err:
        raise ConfigError(f"{name}: {err}") from None
