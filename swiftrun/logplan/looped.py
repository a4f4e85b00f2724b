"""Selective logging for interleaved (looped) schedules: from virtual stages to pipeline positions and back.

Pure: no torch, no I/O. The runtime (swiftrun/runtime/pp/selective.py) measures per rank and per virtual boundary;
this module turns that into the planner's input (swiftrun/logplan/planner.py) and the planner's position-level
plan into the virtual boundaries that must be logged.

With an interleaved schedule, rank ``r`` of ``P`` (pipeline *position* ``r``) runs the virtual stages ``r, r+P,
r+2P, ...``. A failure takes a rank, so all of its virtual stages fail together: the unit the plan groups is the
position, as with one stage per rank. Virtual boundary ``s`` (between virtual stages ``s`` and ``s+1``) joins
positions ``s % P`` and ``(s+1) % P``, so the positions form a *ring*:

- edge ``e < P-1`` joins positions ``e`` and ``e+1``: it carries virtual boundaries ``e, e+P, e+2P, ...`` (one per
  round of virtual stages, ``V`` of them for ``V`` virtual stages per rank);
- edge ``P-1``, the *wrap*, joins position ``P-1`` back to position 0: it carries the boundaries ``kP-1 -> kP``
  between rounds (``V-1`` of them).

Cost model per position (the planner's, unchanged): a position's compute is the sum of its virtual stages'
(forward and backward chunks: what its rank computes per iteration, which is what it replays); an edge's bytes
are the sum, both directions, over the virtual boundaries it carries; the wrap is the planner's ``wrap_bytes``.
A logging group is an arc of the ring (it may wrap around); a virtual boundary is logged exactly when its two
positions are in different groups, which for a plan with at least two cuts is exactly the virtual boundaries of
the cut edges, so the planner's byte count is the log's. With one virtual stage per rank there is no wrap
boundary and the positions form the usual chain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swiftrun.logplan.planner import LoggingPlan, PlanError, PlanInput


def position_input(
    owner: Sequence[int],
    compute_seconds: Sequence[float],
    boundary_bytes: Mapping[int, int],
    ckpt_every: int,
    **options: object,
) -> PlanInput:
    """The planner's input over pipeline positions.

    ``owner[s]``: the position running virtual stage ``s`` (``s % P`` for a looped schedule); ``compute_seconds[p]``:
    position ``p``'s compute per iteration, all its virtual stages; ``boundary_bytes[s]``: bytes per iteration
    crossing virtual boundary ``s`` both directions (absent: 0). Raises :class:`PlanError` when a virtual boundary
    joins positions that are not neighbours on the ring (the plan's groups of consecutive positions would not
    describe what fails together), or when a position runs no stage. A placement whose boundaries all join
    neighbours without wrapping (a "V": rank r runs r and 2P-1-r) is a chain.
    """
    positions = len(compute_seconds)
    if sorted(set(owner)) != list(range(positions)):
        raise PlanError(f"virtual stages are run by positions {sorted(set(owner))}, not by each of 0..{positions - 1}")
    edges = [0] * positions
    wraps = False
    for s in range(len(owner) - 1):
        a, b = owner[s], owner[s + 1]
        if a == b:  # both stages on one rank: it never crosses ranks, nothing to log
            continue
        edge = edge_of(a, b, positions)
        if edge is None:
            raise PlanError(f"virtual stages {s} and {s + 1} run on positions {a} and {b}, which are not neighbours "
                            "in the pipeline: groups of consecutive ranks cannot describe this placement (looped "
                            "placements, rank r running stages r, r+P, ..., are planned)")
        edges[edge] += int(boundary_bytes.get(s, 0))
        wraps |= edge == positions - 1
    sizes = edges[: positions - 1]
    wrap = edges[positions - 1] if wraps else None
    return PlanInput.from_lists(list(compute_seconds), sizes, ckpt_every, wrap_bytes=wrap, **options)


def edge_of(a: int, b: int, positions: int) -> int | None:
    """The ring edge joining positions ``a`` and ``b`` (``e`` joins ``e`` and ``(e+1) % P``); None if none does."""
    if a == b:
        return None
    if (a + 1) % positions == b:  # with two positions both edges join them: a -> b is a's edge
        return a
    if (b + 1) % positions == a:
        return b
    return None


def logged_virtual_boundaries(plan: LoggingPlan, owner: Sequence[int]) -> set[int]:
    """The virtual boundaries the runtime must log for ``plan``: those whose positions are in different groups."""
    group_of = {position: index for index, members in enumerate(plan.members) for position in members}
    return {s for s in range(len(owner) - 1) if group_of[owner[s]] != group_of[owner[s + 1]]}


def looped_owner(positions: int, virtual_stages: int) -> list[int]:
    """``owner`` of a looped schedule: virtual stage ``s`` runs on position ``s % P``."""
    return [s % positions for s in range(virtual_stages)]
