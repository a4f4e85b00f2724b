"""The goodput model of scripts/goodput.py: pure arithmetic over named inputs, each with its source.

Goodput is the fraction of wall time that makes training progress. For a job of N GPUs, failures arrive as a
Poisson process of rate N / MTBF_GPU (or at a job MTTF fitted to job size). Each failure has a cause; each cause
takes a recovery *path* (a process restart, a hang, a lost node) whose cost depends on the method:

- swiftrun: the failed ranks are replaced in place; the whole job waits for the recovery (detect, rebuild the
  process groups, copy state from a replica, redo at most one step);
- torchrun with periodic checkpoints: every worker restarts and reloads the last checkpoint; the work since it is
  redone; checkpoints stall training, at the interval that is optimal by Young/Daly for their cost;
- a torchft-like policy: every group stalls until the failed replica group's collective times out, then the other
  groups go on without it (its step skipped: not the failure-free run) while it restarts and heals from a peer.

What grows with N is modelled explicitly (a process group's NCCL initialisation, a store barrier); what was
measured on a 2-core machine is used for what does not (spawning a replacement, the supervisor's decisions, a
restart's own time), with this machine's local process-group rebuild and state copy taken out and the modelled
ones put in. Every input is printed with its source by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum


class Path(str, Enum):
    """How a failure is recovered: the process is restarted, a hang must first be noticed, or a node is lost."""

    PROCESS = "process"
    HANG = "hang"
    NODE = "node"


class Method(str, Enum):
    SWIFTRUN = "swiftrun"
    TORCHRUN = "torchrun+ckpt"
    TORCHFT = "torchft-like"


@dataclass(frozen=True)
class Cause:
    name: str
    count: int  # Llama 3 405B's unexpected interruptions of this cause
    path: Path
    what: str


# Llama 3 405B (arXiv 2407.21783, Table 5), 419 unexpected interruptions in 54 days on 16,384 H100, grouped by what a
# launcher must do about them (the grouping is ours, as in ../shared/design/LANDSCAPE.md section 4). A GPU fault
# (faulty GPU, HBM3, SRAM, GPU system processor, SDC, thermal) is taken as costing its node, the conservative
# reading: a rank cannot be restarted on a GPU that is gone.
LLAMA3_CAUSES = (
    Cause("gpu", 148 + 72 + 19 + 17 + 6 + 6, Path.NODE, "GPU faults (faulty GPU, HBM3, SRAM, GSP, SDC, thermal)"),
    Cause("host", 32 + 3 + 3 + 2 + 2 + 2 + 2, Path.NODE,
          "host and node (maintenance, SSD, PSU, chassis, IO board, CPU, memory)"),
    Cause("network", 35 + 7, Path.NODE, "network (switch, cable, NIC)"),
    Cause("software", 54 + 2, Path.PROCESS, "software bugs and dependencies"),
    Cause("hang", 7, Path.HANG, "NCCL watchdog timeouts (hangs)"),
)
LLAMA3_GPUS, LLAMA3_DAYS = 16_384, 54


@dataclass(frozen=True)
class Published:
    """The published figures the model uses (LANDSCAPE.md and ANCHORS.md hold each one's context)."""

    # Meta RSC (Kokolis et al., HPCA'25, arXiv 2410.21680; via Clockwork): fitted job MTTF by job size, hours
    rsc_mttf_h: tuple[tuple[int, float], ...] = ((1_024, 7.9), (16_384, 1.8), (131_072, 14 / 60))
    # NCCL communicator initialisation: 4.5 s on 8 GPUs (NVIDIA/nccl#587), ~265 s stock at 96k GPUs (NCCLX paper,
    # arXiv 2510.20171, secondary); a power law through the two
    nccl_init_s: tuple[tuple[int, float], ...] = ((8, 4.5), (98_304, 265.0))
    # a TCPStore-based barrier: 0.5 s at 16k ranks (NVRx in-process usage guide); taken as linear in N
    barrier_s_at_16k: float = 0.5
    # PyTorch's NCCL collective timeout (kProcessGroupNCCLDefaultTimeout): how long a hang goes unnoticed
    nccl_timeout_s: float = 600.0
    # a checkpoint's training stall: DCP async save, 6.3 s per 7B checkpoint (LANDSCAPE section 4, item 6)
    ckpt_stall_s: float = 6.3
    # a checkpoint's load at restart: 8 min (Ant Group / DLRover, stabilize_llm_training_cn.md)
    ckpt_load_s: float = 480.0
    # a replacement node when no spare is at hand: pod scheduling ~5 min (Ant Group / DLRover)
    node_replace_s: float = 300.0
    # torchft: a survivor waits for the failed group's all-reduce to time out (Manager timeout default 60 s,
    # torchft#164), then the group restarts and heals: ~20 s fault to full recovery (torchft#329, after the NIC fix)
    torchft_stall_s: float = 60.0
    torchft_heal_s: float = 20.0
    # torchft's per-step quorum is "negligible" for step times in seconds (torchft docs); a vendor measured 930 min
    # against 818 for checkpoint restart (Clockwork): the favourable figure is the default
    torchft_overhead: float = 0.0
    # a state copy over one link: 25-50 GB/s (LANDSCAPE section 3, inferred); the low end
    link_gb_per_s: float = 25.0


@dataclass(frozen=True)
class Measured:
    """What the goodput script measured on this machine (seconds, fractions), in the same invocation."""

    swift_rank_lost_s: float  # one rank's SIGKILL to training resumed (swiftrun's recovery_end.total)
    swift_rank_local_s: float  # of which this machine's process-group rebuild and state copy (replaced by the model)
    swift_node_lost_s: float  # a node's SIGKILL to training resumed on a hot spare (detection included)
    swift_node_local_s: float  # of which the local rebuild and state copy
    # failure-free: what a step takes longer than under torchrun, in seconds (may be noise below zero). Taken as a
    # fixed cost per step (the runtime's messages, heartbeats, backups of RNG and loader state), not a fraction: a
    # toy step of milliseconds here would otherwise stand for a 5 s step at scale
    swift_step_extra_s: float
    torchrun_restart_s: float  # a torchrun restart from a checkpoint, the steps redone since it taken out
    swift_hang_detect_s: float  # --heartbeat-timeout (or --progress-timeout): swiftrun's own setting


@dataclass(frozen=True)
class Job:
    """The job modelled: its size and what one of its steps and one GPU's state cost."""

    gpus: int
    step_s: float = 5.0
    state_gb_per_gpu: float = 20.0
    gpus_per_node: int = 8
    replica_groups: int = 8  # torchft: the data-parallel replica groups
    hot_spare: bool = True  # a spare node is at hand (else a lost node waits for a replacement)
    failure_model: str = "llama3"  # or "rsc"


@dataclass(frozen=True)
class Breakdown:
    """One method's goodput for one job, and what it is made of."""

    method: Method
    goodput: float
    mtbf_s: float
    overhead: float  # failure-free fraction of time lost (checkpoint stalls, per-step costs)
    loss_per_failure_s: float  # expected over causes
    loss_by_path_s: dict[str, float] = field(default_factory=dict)
    ckpt_interval_s: float | None = None
    exact: bool = True  # the run equals the failure-free one


def gpu_hours_per_failure() -> float:
    """Llama 3's GPU-hours per unexpected interruption (~50,700)."""
    return LLAMA3_GPUS * LLAMA3_DAYS * 24 / sum(c.count for c in LLAMA3_CAUSES)


def _loglog(points: tuple[tuple[int, float], ...], n: float) -> float:
    """Piecewise power-law interpolation through ``points`` (extrapolated with the nearest segment's slope)."""
    pts = sorted(points)
    i = max(0, min(len(pts) - 2, next((k - 1 for k, (x, _) in enumerate(pts) if x >= n), len(pts) - 2)))
    (x0, y0), (x1, y1) = pts[i], pts[i + 1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y0 * (n / x0) ** slope


def job_mtbf_s(job: Job, pub: Published) -> float:
    """Mean time between the job's failures."""
    if job.failure_model == "rsc":
        return _loglog(pub.rsc_mttf_h, job.gpus) * 3600
    if job.failure_model != "llama3":
        raise ValueError(f"unknown failure model {job.failure_model!r} (llama3 or rsc)")
    return gpu_hours_per_failure() / job.gpus * 3600


def nccl_init_s(gpus: int, pub: Published) -> float:
    return _loglog(pub.nccl_init_s, gpus)


def barrier_s(gpus: int, pub: Published) -> float:
    return pub.barrier_s_at_16k * gpus / 16_384


def daly_interval_s(ckpt_s: float, mtbf_s: float) -> float:
    """Daly's (2006) first-order optimum checkpoint interval, sqrt(2 C M) - C (Young's sqrt(2 C M) less C)."""
    return max(ckpt_s, math.sqrt(2 * ckpt_s * mtbf_s) - ckpt_s)


def cause_weights() -> dict[Path, float]:
    total = sum(c.count for c in LLAMA3_CAUSES)
    out = {p: 0.0 for p in Path}
    for c in LLAMA3_CAUSES:
        out[c.path] += c.count / total
    return out


def swift_rebuild_s(job: Job, pub: Published) -> float:
    """What a swiftrun recovery spends at N on what grows with N or the state: new communicators for every rank, a
    store barrier, the replacement's state over one link."""
    return nccl_init_s(job.gpus, pub) + barrier_s(job.gpus, pub) + job.state_gb_per_gpu / pub.link_gb_per_s


def swift_loss_s(path: Path, job: Job, pub: Published, m: Measured) -> float:
    rebuild = swift_rebuild_s(job, pub)
    # the step the failure interrupted is redone from its start: counted as a whole step, the most it can be
    rank = max(0.0, m.swift_rank_lost_s - m.swift_rank_local_s) + rebuild + job.step_s
    if path is Path.PROCESS:
        return rank
    if path is Path.HANG:
        return m.swift_hang_detect_s + rank
    node = max(0.0, m.swift_node_lost_s - m.swift_node_local_s) + rebuild + job.step_s
    return node + (0.0 if job.hot_spare else pub.node_replace_s)


def torchrun_restart_s(path: Path, job: Job, pub: Published, m: Measured) -> float:
    """A whole-job restart without the work redone: every worker restarts, the communicators and the store are
    built again, the checkpoint is loaded; a hang is noticed only at the NCCL timeout; a lost node is replaced."""
    cost = m.torchrun_restart_s + nccl_init_s(job.gpus, pub) + barrier_s(job.gpus, pub) + pub.ckpt_load_s
    if path is Path.HANG:
        cost += pub.nccl_timeout_s
    if path is Path.NODE and not job.hot_spare:
        cost += pub.node_replace_s
    return cost


def torchft_loss_s(path: Path, job: Job, pub: Published) -> float:
    """Every group waits for the failed group's collective to time out; then only that group's share of the work is
    lost while it restarts and heals (a hang is the same timeout; a node loss adds a replacement without a spare)."""
    restart = pub.torchft_heal_s + (0.0 if (path is not Path.NODE or job.hot_spare) else pub.node_replace_s)
    return pub.torchft_stall_s + restart / job.replica_groups


def breakdown(method: Method, job: Job, pub: Published, m: Measured) -> Breakdown:
    mtbf = job_mtbf_s(job, pub)
    weights = cause_weights()
    if method is Method.TORCHRUN:
        restart = {p: torchrun_restart_s(p, job, pub, m) for p in Path}
        mean_restart = sum(weights[p] * restart[p] for p in Path)
        interval = daly_interval_s(pub.ckpt_stall_s, mtbf)
        redo = (interval + pub.ckpt_stall_s) / 2  # the work since the last checkpoint, on average half a period
        overhead = pub.ckpt_stall_s / (interval + pub.ckpt_stall_s)
        loss = {p.value: restart[p] + redo for p in Path}
        mean = mean_restart + redo
        return Breakdown(method, (1 - overhead) * mtbf / (mtbf + mean), mtbf, overhead, mean, loss, interval)
    if method is Method.SWIFTRUN:
        loss = {p.value: swift_loss_s(p, job, pub, m) for p in Path}
        overhead = max(0.0, m.swift_step_extra_s) / job.step_s  # noise below zero is no gain
        exact = True
    else:
        loss = {p.value: torchft_loss_s(p, job, pub) for p in Path}
        overhead = pub.torchft_overhead
        exact = False  # the failed group's batches are skipped
    mean = sum(weights[p] * loss[p.value] for p in Path)
    return Breakdown(method, (1 - overhead) * mtbf / (mtbf + mean), mtbf, overhead, mean, loss, None, exact)


def sweep(sizes: tuple[int, ...], job: Job, pub: Published, m: Measured) -> dict[int, dict[Method, Breakdown]]:
    return {n: {meth: breakdown(meth, replace(job, gpus=n), pub, m) for meth in Method} for n in sizes}
