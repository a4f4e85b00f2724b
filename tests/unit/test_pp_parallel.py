"""Parallel replay's pieces in one process: micro-batch ranges, who helps, and the gradient fold being bitwise
equal to autograd's own accumulation over the micro-batches (runtime/pp/parallel.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward

from swiftrun.runtime.pp import parallel as pp_parallel
from swiftrun.runtime.pp.pipeline import _generators, _mix
from swiftrun.runtime.pp.plan import PipePlan, Replay


def test_ranges_are_contiguous_and_cover_every_micro_batch():
    assert pp_parallel.ranges(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert pp_parallel.ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert pp_parallel.ranges(2, 5) == [(0, 1), (1, 2)]
    assert pp_parallel.ranges(5, 1) == [(0, 5)]


def test_helpers_are_idle_survivors_of_a_single_rank_replay():
    one = Replay(ranks=(2,), start=4, sources=((2, 3),), peers=(1, 3), stages=(2,))
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(one,)), 4, -1) == {2: (0, 1, 3)}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(one,)), 4, 2) == {2: (0, 1)}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(one,)), 4, 0) == {}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(one,), copies=((4, (5,)),)), 6, -1) == \
        {2: (0, 1, 3, 4)}
    assert pp_parallel.assign_helpers(PipePlan(point=5), 4, -1) == {}


def _one(rank: int, together: tuple[int, ...] = ()) -> Replay:
    return Replay(ranks=(rank,), start=4, sources=((rank, rank + 1),), peers=(rank - 1, rank + 1), stages=(rank,),
                  together=together)


def test_idle_survivors_are_shared_out_among_several_single_rank_replays():
    two = PipePlan(point=5, replays=(_one(1), _one(4)))
    # 6 stages, 1 and 4 lost: contiguous shares of the idle ranks 0, 2, 3, 5, sets in plan order
    assert pp_parallel.assign_helpers(two, 6, -1) == {1: (0, 2), 4: (3, 5)}
    assert pp_parallel.assign_helpers(two, 6, 1) == {1: (0,), 4: (3,)}  # the cap is per set
    # uneven: the earlier sets take the larger shares; a set left without a helper replays alone
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(_one(1), _one(3))), 7, -1) == \
        {1: (0, 2, 4), 3: (5, 6)}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(_one(0), _one(2), _one(4))), 5, -1) == \
        {0: (1,), 2: (3,)}
    three = PipePlan(point=5, replays=(_one(1), _one(3), _one(5)))
    assert pp_parallel.assign_helpers(three, 6, -1) == {1: (0,), 3: (2,), 5: (4,)}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(_one(1), _one(3), _one(5))), 7, -1) == \
        {1: (0, 2), 3: (4,), 5: (6,)}
    # a set of two next to one of one: shares 2 and 1 of the idle ranks 0, 2, 3; the pair's share makes one chain
    pair = Replay(ranks=(4, 5), start=4, sources=((4, -2), (5, 5)), peers=(3,), stages=(4, 5))
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(pair, _one(1))), 6, -1) == {4: (0,), 5: (2,), 1: (3,)}
    # the other way round the pair's share (one rank) is too small for a chain: it replays alone
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(_one(1), pair)), 6, -1) == {1: (0, 2)}
    # lockstep replicas (a DDP stage) replay alone, and their partners are not idle
    lockstep = PipePlan(point=5, replays=(_one(0, (0, 2)), _one(2, (0, 2))))
    assert pp_parallel.assign_helpers(lockstep, 4, -1) == {}


def test_a_set_of_several_ranks_takes_chains_of_one_helper_per_member():
    pair = Replay(ranks=(3, 2), start=4, sources=((2, 4), (3, 3)), peers=(1,), stages=(2, 3))
    # 4 stages, groups [0,1] [2,3], rank 2 lost: one chain, rank 0 runs stage 2's copy, rank 1 stage 3's
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(pair,)), 4, -1) == {2: (0,), 3: (1,)}
    # 9 ranks, a set of three (3, 4, 5): six idle ranks make two chains (0, 1, 2) and (6, 7, 8), members' columns
    three = Replay(ranks=(3, 4, 5), start=4, sources=((3, 3), (4, 4), (5, 6)), peers=(2, 6), stages=(3, 4, 5))
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(three,)), 9, -1) == \
        {3: (0, 6), 4: (1, 7), 5: (2, 8)}
    # --parallel-replay caps the helpers of the set: 5 leaves one chain, 2 none (fewer than its three members)
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(three,)), 9, 5) == {3: (0,), 4: (1,), 5: (2,)}
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(three,)), 9, 2) == {}
    tail = Replay(ranks=(2, 3, 4), start=4, sources=((2, 3), (3, 4), (4, 0)), peers=(1,), stages=(2, 3, 4))
    assert pp_parallel.assign_helpers(PipePlan(point=5, replays=(tail,)), 5, -1) == {}  # idle 0, 1: no chain


def _stage(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Dropout(0.2), nn.Linear(64, 64))


def _grads_of_one(module: nn.Module, x: torch.Tensor, g: torch.Tensor, mb: int) -> list[torch.Tensor | None]:
    for p in module.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    with pp_parallel.seeded(_generators(torch.device("cpu")), _mix(7, 3, 1, mb)):
        out = module(x)
    stage_backward((out,), (g,), [x])
    grads = [p.grad for p in module.parameters()]
    for p in module.parameters():
        p.grad = None
    return grads


def test_fold_along_a_chain_is_bitwise_autograd_accumulation():
    torch.manual_seed(1)
    n = 8
    xs = [torch.randn(16, 64) for _ in range(n)]
    gs = [torch.randn(16, 64) for _ in range(n)]
    whole = _stage()
    for mb in range(n):  # what the schedule does alone: every micro-batch accumulated into .grad, in order
        x = xs[mb].clone().requires_grad_(True)
        with pp_parallel.seeded(_generators(torch.device("cpu")), _mix(7, 3, 1, mb)):
            out = whole(x)
        stage_backward((out,), (gs[mb],), [x])
    want = [p.grad.clone() for p in whole.parameters()]

    parts = pp_parallel.ranges(n, 3)
    lo, hi = parts[0]  # the replacement: its range accumulated by autograd
    leader = _stage()
    for mb in range(lo, hi):
        x = xs[mb].clone().requires_grad_(True)
        with pp_parallel.seeded(_generators(torch.device("cpu")), _mix(7, 3, 1, mb)):
            out = leader(x)
        stage_backward((out,), (gs[mb],), [x])
    partial = [p.grad for p in leader.parameters()]
    for lo, hi in parts[1:]:  # each helper: per-micro-batch gradients computed apart, folded in order
        helper = _stage()
        per_mb = [_grads_of_one(helper, xs[mb], gs[mb], mb) for mb in range(lo, hi)]
        partial = pp_parallel.fold(partial, per_mb)
    assert all(torch.equal(a, b) for a, b in zip(partial, want))

    # summing per-range partial sums instead is not bitwise (why the fold is a chain)
    sums = []
    for lo, hi in parts:
        sums.append(pp_parallel.fold([None] * len(want),
                                     [_grads_of_one(_stage(), xs[mb], gs[mb], mb) for mb in range(lo, hi)]))
    added = [sums[0][j] + sums[1][j] + sums[2][j] for j in range(len(want))]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(added, want))


class _Counting(nn.Module):
    """A forward with a side effect a helper cannot reproduce: the mask depends on how many forwards ran."""

    def __init__(self, clock: object) -> None:
        super().__init__()
        self.lin, self.calls, self.clock = nn.Linear(4, 4), 0, clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class _Clock:
    def __init__(self) -> None:
        self.step = 0


def test_side_state_sees_what_a_forward_changes():
    """A stage whose forward changes a counter, a buffer (BatchNorm's running statistics) or a generator of its own
    cannot be split between helpers; a plain stage with dropout can (campaign seed 1, train_pp.py's dropout)."""
    x = torch.randn(3, 4)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    before = pp_parallel.side_state(plain)
    plain(x)
    assert pp_parallel.changed_by(before, pp_parallel.side_state(plain)) == []

    counting = _Counting(_Clock())
    before = pp_parallel.side_state(counting)
    counting(x)
    assert pp_parallel.changed_by(before, pp_parallel.side_state(counting)) == [".calls"]
    counting.clock.step = 5  # the script's clock object, held by the module: its attributes are seen too
    assert pp_parallel.changed_by(before, pp_parallel.side_state(counting)) == [".calls", ".clock.step"]

    norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    before = pp_parallel.side_state(norm)
    norm(x)
    assert {"1.buffer.running_mean", "1.buffer.running_var", "1.buffer.num_batches_tracked"} <= \
        set(pp_parallel.changed_by(before, pp_parallel.side_state(norm)))
