"""Rebinding a DistributedDataParallel module to the process group of a new generation.

Two things must hold after a recovery, on every rank, survivors and replacements alike:

1. the reducer talks to the new group and carries no half-finished reduction from the aborted step;
2. every rank uses the *same gradient buckets*, and the ones failure-free training would use. Bucket layout
   decides which gradients are summed together in one all-reduce, so it decides the floating-point result:
   a replacement's fresh reducer starts from the initial layout while survivors run the layout rebuilt after
   their first iteration, and the two differ even for a plain MLP (measured: one bucket of 2.45 MB initially,
   two buckets of 2.44 MB and 11 KB after the rebuild). Mismatched buckets would sum the wrong tensors.

So every rank rebuilds its reducer with the layout the source rank reports (the rebuilt one once training has
run an iteration), by re-running DDP's own reducer construction with that bucket assignment. The new reducer
rebuilds its buckets again after its first iteration, from the real gradient order, which reproduces the same
layout; that is what keeps recovered training bitwise equal to failure-free training.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from swiftrun.runtime import subgroups

Layout = list[list[int]]  # bucket -> parameter indices, in the order the reducer reduces them
_FORCED = "_swiftrun_forced_layout"  # attribute on the DDP module: the layout rebind() last gave its reducer


def current_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The bucket layout in use, or None while DDP still runs its initial (unrebuilt) layout.

    A reducer built by :func:`rebind` reports no rebuilt layout until it rebuilds after its first iteration;
    until then the layout in use is the one it was given (a second failure can come that soon)."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if text:
        return [[int(i) for i in bucket.split()] for bucket in str(text).split(",")]
    return getattr(ddp, _FORCED, None)


def rebind(ddp: DistributedDataParallel, layout: Layout | None) -> None:
    """Rebuild ``ddp``'s reducer on the current generation's group, with ``layout`` (None: DDP's initial layout).

    The group is the default one, or the current counterpart of the script's subgroup DDP was built on (a
    stage's data-parallel group in a DP x PP job, see runtime/subgroups.py)."""
    parameters, expect_sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    original = dist._compute_bucket_assignment_by_size
    if layout is not None:
        sizes = [sum(parameters[i].numel() * parameters[i].element_size() for i in bucket) for bucket in layout]
        # DDP reverses the assignment it computes (to approximate gradient order); hand it the reverse of ours
        forced = (list(reversed(layout)), list(reversed(sizes)))

        def assignment(*_args, **_kwargs):
            return forced

        dist._compute_bucket_assignment_by_size = assignment
    try:
        mapped = subgroups.current(ddp.process_group)
        ddp.process_group = mapped if mapped is not ddp.process_group or _alive(mapped) else dist.group.WORLD
        ddp._has_rebuilt_buckets = False
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = original
    if ddp.static_graph:
        # DDP's constructor tells a static-graph reducer so after _ddp_init_helper; a rebuilt reducer must be
        # told again, or its first backward fails (it would expect the dynamic-graph bookkeeping)
        ddp._static_graph_delay_allreduce_enqueued = False
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    setattr(ddp, _FORCED, layout)
    for hook, state in list(ddp._comm_hooks):  # a user's comm hook lived on the old reducer
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp.require_backward_grad_sync = True


def _alive(group) -> bool:
    """Whether a group belongs to the current default group's world (not destroyed with an older one)."""
    return group in dist.distributed_c10d._world.pg_map
