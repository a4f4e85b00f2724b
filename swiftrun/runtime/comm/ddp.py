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

Before DDP's own rebuild there is no rebuilt layout to hand on, yet training may already need it: DDP records the
order in which gradients become ready during its first backward and rebuilds its buckets from it at the *second*
forward (and reports the result only at the third). A recovery whose redo is step 1 or 2 must run the rebuilt
layout, as the failure-free run does; a reducer rebuilt by the recovery has recorded nothing, so it would run
the initial layout one iteration longer (about 1e-7 relative off at the end, campaign seed 2 run 4).
:class:`ReadyOrder` therefore records that order itself (a post-accumulate-grad hook per parameter, removed
once DDP reports its rebuild) and :func:`predicted_layout` computes the layout DDP's rebuild makes of it, with
DDP's own assignment function and bucket caps (checked equal to DDP's rebuilt layout, tests/unit/test_ddp.py).
A static graph does all of this one iteration later (its first iteration only records the graph); one recovered
after its first step is rebound once more at step 2 (runtime/core/recovery.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from swiftrun.runtime.comm import abortable

from swiftrun.runtime.comm import subgroups

Layout = list[list[int]]  # bucket -> parameter indices, in the order the reducer reduces them
ABORTABLE_HOOK = "swiftrun.abortable_allreduce"
_FORCED = "_swiftrun_forced_layout"  # attribute on the DDP module: the layout rebind() last gave its reducer


def current_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The bucket layout in use, or None while DDP still runs its initial (unrebuilt) layout.

    A reducer built by :func:`rebind` reports no rebuilt layout until it rebuilds after its first iteration;
    until then the layout in use is the one it was given (a second failure can come that soon)."""
    return rebuilt_layout(ddp) or getattr(ddp, _FORCED, None)


def rebuilds(ddp: DistributedDataParallel) -> bool:
    """Whether DDP rebuilds its buckets after its first iteration (the reducer's own condition): with
    ``find_unused_parameters`` and a dynamic graph it never does, and its initial layout is exact as it is."""
    return ddp.static_graph or not ddp.find_unused_parameters


def first_rebuilt_step(ddp: DistributedDataParallel) -> int:
    """The first iteration that runs the rebuilt layout: the second, or with a static graph (whose first
    iteration only records the graph, reducing everything at its end) the third (measured: DDP's logging reports
    one bucket reduced in iterations 0 and 1, two from iteration 2 on, in tests/unit/test_ddp.py's model)."""
    return 2 if ddp.static_graph else 1


def rebuilt_layout(ddp: DistributedDataParallel) -> Layout | None:
    """The layout DDP reports having rebuilt, if it reports one yet."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    return [[int(i) for i in bucket.split()] for bucket in str(text).split(",")] if text else None


class ReadyOrder:
    """The order in which ``ddp``'s gradients became ready in its last complete backward (parameter indices as
    the reducer numbers them), recorded until DDP reports its own rebuilt layout.

    Like DDP's rebuild, this assumes every iteration readies the gradients in the same order (a static graph);
    a backward under ``no_sync`` is recorded too, since it runs the same graph."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        parameters, _ = ddp._build_params_for_reducer()
        self._count = len(parameters)
        self._current: list[int] = []
        self._seen: set[int] = set()
        self.order: list[int] | None = None  # the last complete order
        self._handles = [p.register_post_accumulate_grad_hook(functools.partial(self._ready, index))
                         for index, p in enumerate(parameters)]

    def _ready(self, index: int, _param: object) -> None:
        if index in self._seen:  # a new backward (a micro-batch, or a step redone after a failure mid-backward)
            self._current, self._seen = [], set()
        self._current.append(index)
        self._seen.add(index)
        if len(self._current) == self._count:
            self.order = list(self._current)

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def close(self) -> None:
        """DDP reports its rebuilt layout now: the hooks' work per backward is no longer needed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def predicted_layout(ddp: DistributedDataParallel, order: list[int]) -> Layout:
    """The layout DDP's rebuild makes from a gradient-ready ``order``, computed as its reducer does."""
    parameters, expect_sparse = ddp._build_params_for_reducer()
    first_cap = dist._DEFAULT_FIRST_BUCKET_BYTES if ddp.bucket_bytes_cap_default else ddp.bucket_bytes_cap
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [parameters[i] for i in order], [first_cap, ddp.bucket_bytes_cap], [expect_sparse[i] for i in order], order)
    return [list(bucket) for bucket in buckets]


def next_layout(ddp: DistributedDataParallel, order: ReadyOrder | None, point: int) -> Layout | None:
    """The layout the failure-free run uses at step ``point + 1``: DDP's rebuilt one, the one a recovery installed
    (until the reducer rebuilds it again), the prediction from the recorded order from the first rebuilt step
    on, else the initial layout (None).

    A static graph recovered at point 0 gets None, right for step 1, but its rebound reducer counts step 1 as its
    first iteration and would rebuild one step later than DDP does: the recovery rebinds it at step 2."""
    layout = current_layout(ddp)
    if (layout is None and point + 1 >= first_rebuilt_step(ddp) and order is not None and order.order is not None
            and rebuilds(ddp)):
        layout = predicted_layout(ddp, order.order)
    return layout


def rebind(ddp: DistributedDataParallel, layout: Layout | None) -> None:
    """Rebuild ``ddp``'s reducer on the current generation's group, with ``layout`` (None: DDP's initial layout).

    The group is the default one, or the current counterpart of the script's subgroup DDP was built on (a
    stage's data-parallel group in a DP x PP job, see runtime/comm/subgroups.py)."""
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
    _install_comm_hook(ddp)
    ddp.require_backward_grad_sync = True


def _install_comm_hook(ddp: DistributedDataParallel) -> None:
    """The fresh reducer's gradient all-reduce, waited on through a future the launcher's ABORT can fail
    (runtime/comm/abortable.py): the script's own comm hook if it registered one (it lived on the old reducer), else
    DDP's averaging where a hook reproduces it bit for bit. A reducer takes one hook, ever: a script registering
    its own after this gets it installed by a rebind instead (:func:`_late_registration`)."""
    if "register_comm_hook" not in vars(ddp):
        ddp.register_comm_hook = functools.partial(_late_registration, ddp)
    hooks = list(ddp._comm_hooks)
    if hooks:
        for hook, state in hooks:
            dist._register_comm_hook(ddp.reducer, state, abortable.abortable_hook(hook))
    elif abortable.eligible(ddp):
        dist._register_comm_hook(ddp.reducer, (ddp.process_group, abortable.PENDING), abortable.allreduce_hook)
        ddp.logger._set_comm_hook_name(ABORTABLE_HOOK)  # DDP's logging data says which hook runs
    if abortable.eligible(ddp, scaling=False):  # the buffers DDP broadcasts from rank 0 before each forward
        ddp._distributed_broadcast_coalesced = functools.partial(_broadcast_buffers, ddp)


@torch.compiler.disable  # a compiled DDP's forward reaches this; dynamo cannot trace the process group object
def _broadcast_buffers(ddp: DistributedDataParallel, tensors: list, bucket_bytes: int, root: int = 0) -> None:
    """DDP's ``_distributed_broadcast_coalesced`` (``root``: a rank of DDP's group, as DDP passes it), on the group
    DDP runs on now, abortable (runtime/comm/abortable.py). Run eagerly under ``torch.compile``: tracing it failed with
    dynamo's "UnsafeScriptObjectError: Attempted to access unregistered member on an OpaqueObject"
    (tests/integration/test_exactness.py, case compiled-ddp)."""
    abortable.broadcast_coalesced(ddp.process_group, list(tensors), bucket_bytes, root)


def _late_registration(ddp: DistributedDataParallel, state: object, hook) -> None:
    """``ddp.register_comm_hook`` after swiftrun installed its own: what DDP's method does, then a reducer
    rebuilt with the same layout to carry it (DDP allows one hook per reducer)."""
    ddp._check_comm_hook(hook)
    ddp.logger._set_comm_hook_name(hook.__qualname__)
    ddp._comm_hooks.append((hook, state))
    rebind(ddp, current_layout(ddp))


def rebind_optimizers(optimizers: list) -> None:
    """Optimizers that hold a process group (``ZeroRedundancyOptimizer`` captures ``group.WORLD`` when built,
    before ``swiftrun.Run`` rebuilt the default group): point them at the current generation's counterpart, or
    their first ``step()`` fails with "Group ... is not registered"."""
    for opt in optimizers:
        group = getattr(opt, "process_group", None)
        if group is None or type(opt).__name__ != "ZeroRedundancyOptimizer":
            continue
        mapped = subgroups.current(group)
        opt.process_group = mapped if mapped is not group or _alive(mapped) else dist.group.WORLD


def _alive(group) -> bool:
    """Whether a group belongs to the current default group's world (not destroyed with an older one)."""
    return group in dist.distributed_c10d._world.pg_map
