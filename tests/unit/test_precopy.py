"""When the job keeps a pre-step copy for an exact undo, what it says about it, and why an undo was inexact."""

from __future__ import annotations

import torch

from swiftrun.runtime.core.precopy import CopyPolicy, PreStepCopy, estimate_nbytes
from swiftrun.runtime.core.txn import Copier

GiB = 2**30


def test_the_default_copies_once_the_job_may_undo_and_the_flags_override_it():
    policy = CopyPolicy(None, None)
    assert not policy.wanted()  # nothing says this job may undo a completed step
    assert policy.saw_collective_after_update("all_reduce", 3)
    assert policy.wanted() and "step 3 issues all_reduce() after optimizer.step()" in policy.reason
    assert not policy.saw_collective_after_update("all_reduce", 4)  # said once
    assert CopyPolicy(None, "--recovery undo").wanted()
    assert CopyPolicy(True, None).wanted()
    assert not CopyPolicy(False, "--recovery undo").wanted()


def test_the_default_declines_a_copy_that_would_crowd_the_host_and_says_so_once():
    policy = CopyPolicy(None, "DDP broadcasts buffers", local_ranks=8)
    said = policy.afford(estimate=1 * GiB, available=12 * GiB)  # 8 GiB for 8 ranks > half of 12 GiB
    assert said is not None and "exact undo declined" in said and "8.0 GiB" in said and "--exact-undo" in said
    assert not policy.wanted()
    assert policy.afford(1 * GiB, 12 * GiB) is None  # checked once
    assert "exact undo was declined" in policy.why_inexact(5, "AdamW")
    roomy = CopyPolicy(None, "DDP broadcasts buffers", local_ranks=2)
    assert roomy.afford(1 * GiB, 12 * GiB) is None and roomy.wanted()
    forced = CopyPolicy(True, None, local_ranks=8)
    assert forced.afford(1 * GiB, 1 * GiB) is None and forced.wanted()  # --exact-undo copies anyway


def test_the_cost_is_announced_once_and_an_inexact_undo_names_its_cause():
    policy = CopyPolicy(None, "--recovery undo")
    said = policy.announcement(3 * 2**20)
    assert said is not None and "3.0 MiB per rank" in said and "--no-exact-undo" in said
    assert policy.announcement(3 * 2**20) is None
    assert CopyPolicy(False, None).announcement(1) is None  # nothing is kept
    off = CopyPolicy(False, None).why_inexact(7, "SGD")
    assert off.startswith("step 7's SGD update was inverted arithmetically") and "(--no-exact-undo)" in off
    late = CopyPolicy(None, None).why_inexact(2, "SGD")
    assert "first seen in that step" in late


def test_the_estimate_counts_parameters_and_state_guessing_adams_moments_before_its_first_step():
    param = torch.nn.Parameter(torch.zeros(256))
    optimizer = torch.optim.Adam([param])
    assert estimate_nbytes(optimizer) == 3 * 256 * 4
    param.grad = torch.ones(256)
    optimizer.step()
    assert estimate_nbytes(optimizer) == 3 * 256 * 4 + optimizer.state[param]["step"].element_size()


def test_a_host_copier_keeps_cpu_tensors_in_reused_buffers_and_thaws_private_copies():
    copier = Copier(host=True)  # on the CPU nothing is offloaded: the same buffers as without host
    value = torch.arange(8.0)
    frozen = copier.freeze({"a": value})
    first = frozen["a"]
    assert torch.equal(first, value) and first is not value and copier.nbytes() == 32
    copier.settle()
    again = copier.freeze({"a": value + 1})
    assert again["a"] is first  # reused
    thawed = copier.thaw(again)
    assert torch.equal(thawed["a"], value + 1) and thawed["a"] is not first


def test_a_pre_step_copy_reports_its_size():
    param = torch.nn.Parameter(torch.ones(10))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(10)
    optimizer.step()
    copy = PreStepCopy()
    copy.take(optimizer, 1)
    assert copy.nbytes() == 2 * 10 * 4  # the parameter and its momentum buffer
