"""Cluster conventions: defaults for the multi-node flags from Slurm's environment, and Slurm hostlists.

Pure functions of an environment mapping; nothing here runs ``scontrol`` or touches the network. The order of
precedence is the command line, then ``PET_<NAME>`` (Kubeflow's PyTorchJob, read by the CLI), then Slurm, then
torchrun's defaults.

Slurm (one swiftrun per node: ``srun --ntasks-per-node=1 swiftrun ...``):

- ``SLURM_NODEID`` -> ``--node-rank`` (nodes numbered from 0 in the allocation's order);
- ``SLURM_STEP_NUM_NODES`` (else ``SLURM_JOB_NUM_NODES``) minus ``--spare-nodes`` -> ``--nnodes``: the last
  ``--spare-nodes`` node ranks of the allocation are hot spares;
- ``SLURM_JOB_ID`` -> ``--rdzv-id``;
- the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``) -> the host of ``--rdzv-endpoint``,
  with the c10d backend and its default port.

They apply only inside a Slurm step (``SLURM_NODEID`` and ``SLURM_JOB_ID`` both set) and never with
``SWIFTRUN_SLURM=0``; a flag given on the command line or by ``PET_`` always wins.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from swiftrun.errors import ConfigError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed hostlist -> host names, in order: ``node[01-03,07],gpu-[1-2]`` ->
    ``node01 node02 node03 node07 gpu-1 gpu-2``. Several bracket groups in one name multiply out
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``); a range keeps the zero padding of its lower bound."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_one(item, text))
    return hosts


def first_host(text: str) -> str:
    """The first host of a hostlist, without expanding the rest."""
    hosts = expand_hostlist(_split_top_level(text.strip())[0]) if text.strip() else []
    if not hosts:
        raise ConfigError(f"hostlist {text!r} names no host")
    return hosts[0]


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"hostlist {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise ConfigError(f"hostlist {text!r} has an unmatched '['")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _expand_one(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values: list[str] = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ConfigError(f"hostlist {whole!r}: {part!r} is not a number or a LOW-HIGH range")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ConfigError(f"hostlist {whole!r}: range {part!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    tails = _expand_one(rest, whole)
    return [f"{prefix}{value}{tail}" for value in values for tail in tails]


@dataclass(frozen=True)
class ClusterDefaults:
    """Values a scheduler supplies for flags the user did not give (None: no opinion)."""

    source: str
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_id: str | None = None
    endpoint_host: str | None = None


def slurm_defaults(env: Mapping[str, str], spare_nodes: int = 0) -> ClusterDefaults | None:
    """Defaults from a Slurm step's environment, or None outside one (or with ``SWIFTRUN_SLURM=0``)."""
    if env.get("SWIFTRUN_SLURM", "").strip() == "0":
        return None
    if not env.get("SLURM_JOB_ID") or not env.get("SLURM_NODEID"):
        return None
    node_rank = _int(env, "SLURM_NODEID")
    count_var = "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_JOB_NUM_NODES"
    nnodes = None
    if env.get(count_var):
        total = _int(env, count_var)
        if spare_nodes >= total:
            raise ConfigError(f"--spare-nodes {spare_nodes} leaves no training node of the {total} in {count_var}")
        nnodes = str(total - spare_nodes)
    list_var = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    host = first_host(env[list_var]) if env.get(list_var) else None
    return ClusterDefaults("slurm", nnodes=nnodes, node_rank=node_rank, rdzv_id=env["SLURM_JOB_ID"].strip(),
                           endpoint_host=host)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        value = int(env[name].strip())
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"{name}={value} is negative")
    return value
