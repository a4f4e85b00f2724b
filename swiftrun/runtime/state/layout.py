"""Whether every rank's state has a copy on another rank: what in-place recovery needs, decided at ``Run()``.

In-place recovery gives a replacement its state from a surviving replica. Some layouts keep part of a rank's
state on that rank alone, so a lost rank takes it with it and no replica can give it back:

- ``ZeroRedundancyOptimizer``: each rank of its group holds one shard of the optimizer state;
- FSDP2 (``fully_shard``) and DTensor parameters sharded over a mesh with no dimension that replicates them
  (1-D FSDP, pure tensor parallelism), and legacy ``FullyShardedDataParallel`` other than ``NO_SHARD``;
- a DDP comm hook whose state differs between ranks (PowerSGD: error feedback, warm-start matrices).

HSDP is the sharded layout that *is* recoverable: :func:`replica_sets` works out, from the DTensor placements, which
ranks hold bitwise copies of one another's shards (those whose mesh coordinates differ only on dimensions where
every parameter is ``Replicate``), and the HSDP strategy (runtime/hsdp/) copies a lost rank's shards from one of
them.

An unrecoverable job trains as under torchrun; :func:`unrecoverable` names the cause, the mesh dimension and what
to change, ``Run()`` warns with it at once, and the launcher treats a failure of that job as one in-place
recovery cannot repair: a restart of every worker where ``--max-restarts`` allows (from the script's own
checkpoint, as torchrun would), else a clean stop, within seconds and with this reason, instead of a recovery
that ends in "no surviving replica" or a crash loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from swiftrun.runtime.state.registry import Registry

WHAT_HAPPENS = ("a failure then restarts every worker (with --max-restarts, resuming from the script's own "
                "checkpoint as under torchrun) or stops the job")


def unrecoverable(reg: Registry, sharding_recovered: bool = True) -> str | None:
    """Why a lost rank's state would exist nowhere else, or None when every rank has a replica's copy.
    ``sharding_recovered`` False: the job's strategy cannot copy shards (a pipeline), so any sharding refuses."""
    reasons = [*_zero(reg), *_sharded(reg, sharding_recovered), *_per_rank_hooks(reg)]
    if not reasons:
        return None
    return "; ".join(reasons) + f": in-place recovery is impossible for this job, so {WHAT_HAPPENS}"


def sharded_models(reg: Registry) -> list[str]:
    """The registered models whose parameters are sharded (FSDP, DTensor): their gradient hooks never run."""
    return [type(m).__name__ for m in reg.models if _dtensors(m) or any(True for _ in _legacy_fsdp(m))]


def is_sharded(reg: Registry) -> bool:
    """Whether a registered model holds DTensor parameters (FSDP2, tensor parallelism): the HSDP strategy's."""
    return any(_dtensors(m) for m in reg.models)


def replica_sets(models: list[torch.nn.Module], world_size: int) -> list[tuple[int, ...]]:
    """The ranks that hold bitwise copies of one another's shards, as a partition of the world (sorted sets,
    sorted by first rank). Two ranks are replicas when, for every DTensor parameter, their coordinates in its
    mesh differ only on dimensions where that parameter is ``Replicate`` (HSDP's replicate dimension; TP and
    FSDP's shard dimensions are where copies differ). A rank outside a parameter's mesh does not hold it: such
    ranks are replicas of each other for it. Without DTensor parameters every rank is a replica of every other."""
    layouts: dict[tuple, tuple[Any, list[int]]] = {}  # one entry per (mesh, split dimensions): params share them
    for param in (p for m in models for p in _dtensors(m)):
        mesh = param.device_mesh
        kept = [d for d, placement in enumerate(param.placements)
                if type(placement).__name__ != "Replicate" and mesh.size(d) > 1]
        layouts.setdefault((id(mesh), tuple(kept)), (mesh, kept))
    keys: dict[int, tuple] = {r: () for r in range(world_size)}
    for mesh, kept in layouts.values():
        coords = _coordinates(mesh)
        for r in range(world_size):
            where = coords.get(r)
            keys[r] = keys[r] + ((id(mesh), None if where is None else tuple(where[d] for d in kept)),)
    blocks: dict[tuple, list[int]] = {}
    for r in range(world_size):
        blocks.setdefault(keys[r], []).append(r)
    return sorted((tuple(b) for b in blocks.values()), key=lambda b: b[0])


def _coordinates(mesh: Any) -> dict[int, tuple[int, ...]]:
    grid = mesh.mesh
    out = {}
    for flat, rank in enumerate(grid.reshape(-1).tolist()):
        coord, rest = [], flat
        for size in reversed(grid.shape):
            coord.append(rest % size)
            rest //= size
        out[int(rank)] = tuple(reversed(coord))
    return out


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


def _sharded(reg: Registry, sharding_recovered: bool) -> Iterator[str]:
    for model in reg.models:
        for reason in _legacy_fsdp(model):
            yield reason
            return
    sharded = [p for m in reg.models for p in _dtensors(m) if _split_dims(p)]
    if not sharded:
        return
    what = "FSDP2 (fully_shard)" if any(_fsdp2(m) for m in reg.models) else "DTensor parameters"
    if not sharding_recovered:
        yield (f"{what} inside a pipeline: a pipeline's recovery does not copy shards (a pipeline around FSDP, "
               "torchtitan's layout, is not recovered in place yet)")
        return
    alone = [s for s in replica_sets(reg.models, _world_size()) if len(s) == 1]
    if alone:
        dims = sorted({d for p in sharded for d in _split_dims(p)})
        yield (f"{what} shards the parameters and optimizer state over mesh dimension(s) {', '.join(dims)} and "
               "no mesh dimension replicates them, so a lost rank's shards exist nowhere else (rank(s) "
               f"{', '.join(str(s[0]) for s in alone)} have no replica). For in-place recovery train with HSDP: "
               "a 2-D mesh, init_device_mesh(device, (replicas, shards), mesh_dim_names=(\"replicate\", "
               "\"shard\")), passed to fully_shard(mesh=...)")


def _legacy_fsdp(model: torch.nn.Module) -> Iterator[str]:
    for module in model.modules():
        if type(module).__name__ == "FullyShardedDataParallel":
            strategy = getattr(module, "sharding_strategy", None)
            if strategy is None or getattr(strategy, "name", "") != "NO_SHARD":
                yield (f"legacy FullyShardedDataParallel ({getattr(strategy, 'name', 'sharded')}) is not "
                       "recovered in place (its flat parameters hide which rank holds which copy); FSDP2 with "
                       "HSDP, fully_shard over a 2-D mesh, is")
                return


def _fsdp2(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") and hasattr(m, "reshard") for m in model.modules())


def _dtensors(model: torch.nn.Module) -> list[Any]:
    """The DTensor parameters of ``model`` (no import of torch.distributed.tensor for a plain model)."""
    return [p for p in model.parameters() if type(p).__name__ == "DTensor" and hasattr(p, "device_mesh")]


def _split_dims(param: Any) -> list[str]:
    """The names of the mesh dimensions over which ``param`` is split (not Replicate, size above one)."""
    mesh = param.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim_{d}" for d in range(mesh.ndim))
    return [f"'{names[d]}' ({mesh.size(d)})" for d, placement in enumerate(param.placements)
            if type(placement).__name__ != "Replicate" and mesh.size(d) > 1]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _per_rank_hooks(reg: Registry) -> Iterator[str]:
    for ddp in reg.ddps:
        for _hook, state in getattr(ddp, "_comm_hooks", ()):
            if type(state).__name__ == "PowerSGDState":
                yield ("the PowerSGD comm hook keeps per-rank state (its error feedback, and warm-start matrices) "
                       "that does not travel to a replacement, so the replacement's compressed gradients would "
                       "not match the survivors'")
                break
