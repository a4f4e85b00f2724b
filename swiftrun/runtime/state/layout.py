"""Whether every rank's state has a copy on another rank: what in-place recovery needs, decided at ``Run()``.

In-place recovery gives a replacement its state from a surviving replica. Some layouts keep part of a rank's
state on that rank alone, so a lost rank takes it with it and no replica can give it back:

- ``ZeroRedundancyOptimizer``: each rank of its group holds one shard of the optimizer state;
- FSDP (``fully_shard`` / FSDP2, legacy ``FullyShardedDataParallel`` other than ``NO_SHARD``) and DTensor
  parameters sharded over a mesh dimension: each rank holds its shards of the parameters and their optimizer
  state (HSDP, a replicate dimension around the shards, is a layout swiftrun does not recover in place yet);
- a DDP comm hook whose state differs between ranks (PowerSGD: error feedback, warm-start matrices).

Such a job trains as under torchrun; :func:`unrecoverable` names the cause, ``Run()`` warns with it at once, and
the launcher treats a failure of that job as one in-place recovery cannot repair: a restart of every worker
where ``--max-restarts`` allows (from the script's own checkpoint, as torchrun would), else a clean stop, within
seconds and with this reason, instead of a recovery that ends in "no surviving replica" or a crash loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from swiftrun.runtime.state.registry import Registry

WHAT_HAPPENS = ("a failure then restarts every worker (with --max-restarts, resuming from the script's own "
                "checkpoint as under torchrun) or stops the job")


def unrecoverable(reg: Registry) -> str | None:
    """Why a lost rank's state would exist nowhere else, or None when every rank has a replica's copy."""
    reasons = [*_zero(reg), *_sharded(reg), *_per_rank_hooks(reg)]
    if not reasons:
        return None
    return "; ".join(reasons) + f": in-place recovery is impossible for this job, so {WHAT_HAPPENS}"


def sharded_models(reg: Registry) -> list[str]:
    """The registered models whose parameters are sharded (FSDP, DTensor): their gradient hooks never run."""
    return [type(m).__name__ for m in reg.models if any(True for _ in _shard_reasons(m))]


def unrestorable_data(objects: list[Any]) -> str | None:
    """A data source whose position cannot be backed up or restored: an ``IterableDataset`` (iterated through a
    DataLoader or directly). After a recovery the survivors redo the step with the *next* records and the
    replacement starts its stream from the beginning, so the run is not the failure-free one: said at ``Run()``
    or the first step, and again at each recovery. None when no such source is in sight."""
    from torch.utils.data import DataLoader, IterableDataset

    for obj in objects:
        dataset = obj if isinstance(obj, IterableDataset) else None
        if dataset is None and isinstance(obj, DataLoader) and isinstance(obj.dataset, IterableDataset):
            dataset = obj.dataset
        if dataset is None:
            inner = getattr(obj, "_dataset", None)  # a DataLoader's iterator
            if isinstance(inner, IterableDataset) and type(obj).__name__.endswith("DataLoaderIter"):
                dataset = inner
        if dataset is not None:
            return (f"the job reads a streaming IterableDataset ({type(dataset).__name__}), whose position swiftrun "
                    "can neither back up nor restore: after a recovery the survivors redo the step with the next "
                    "records and the replacement starts its stream from the beginning, so the recovered run is not "
                    "the failure-free one. For exact recovery use a map-style dataset with "
                    "swiftrun.ResumableDistributedSampler and run.steps(loader=...)")
    return None


def _zero(reg: Registry) -> Iterator[str]:
    for opt in reg.optimizers:
        if type(opt).__name__ != "ZeroRedundancyOptimizer":
            continue
        size = getattr(opt, "world_size", 1)
        if size > 1:
            yield (f"ZeroRedundancyOptimizer shards the optimizer state over {size} ranks, so a lost rank's "
                   "shard exists nowhere else (a plain optimizer keeps a whole copy on every DDP replica)")


def _sharded(reg: Registry) -> Iterator[str]:
    for model in reg.models:
        for reason in _shard_reasons(model):
            yield reason
            break


def _shard_reasons(model: torch.nn.Module) -> Iterator[str]:
    for module in model.modules():
        name = type(module).__name__
        if name == "FullyShardedDataParallel":
            strategy = getattr(module, "sharding_strategy", None)
            if strategy is None or getattr(strategy, "name", "") != "NO_SHARD":
                yield (f"legacy FSDP ({getattr(strategy, 'name', 'sharded')}) holds each rank's shard of the "
                       "parameters and optimizer state on that rank only")
                return
        if name.startswith("FSDP") and hasattr(module, "reshard"):  # fully_shard's dynamic FSDPModule class
            yield ("FSDP2 (fully_shard) holds each rank's shard of the parameters and optimizer state on that "
                   "rank only (HSDP, with a replicate dimension, is not recovered in place yet)")
            return
    for param in model.parameters():
        placements = _placements(param)
        if placements and any(type(p).__name__ == "Shard" for p in placements):
            yield ("DTensor parameters are sharded over a device mesh: each rank's shard exists on that rank only "
                   "(HSDP, with a replicate dimension, is not recovered in place yet)")
            return


def _placements(param: Any) -> tuple:
    if type(param).__name__ != "DTensor":  # no import of torch.distributed.tensor for a plain model
        return ()
    mesh = getattr(param, "device_mesh", None)
    sizes = tuple(mesh.shape) if mesh is not None else ()
    return tuple(p for p, size in zip(param.placements, sizes) if size > 1)


def _per_rank_hooks(reg: Registry) -> Iterator[str]:
    for ddp in reg.ddps:
        for _hook, state in getattr(ddp, "_comm_hooks", ()):
            if type(state).__name__ == "PowerSGDState":
                yield ("the PowerSGD comm hook keeps per-rank state (its error feedback, and warm-start matrices) "
                       "that does not travel to a replacement, so the replacement's compressed gradients would "
                       "not match the survivors'")
                break
