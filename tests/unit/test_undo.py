"""Tests for update-undo (swiftrun.runtime.core.undo): inverting the last SGD/Adam/AdamW step in place.

Each grid case trains a few steps on three random tensors, snapshots parameters and optimizer state before the
last step, captures, steps, undoes, and compares with the snapshot. Precision is asserted three ways:

* every element within rtol 1e-6 (with an absolute floor of 1e-6 of the tensor's largest magnitude, for
  elements that cross zero);
* every element within a few ULPs of max(|p_{t-1}|, |p_t|): the step rounded p_t to that resolution, so
  information below it is lost and no inverse can do better;
* a minimum fraction of bit-exact elements, measured on this grid and set a little below the measurement.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim import SGD, Adam, AdamW, Optimizer

from swiftrun.errors import RecoveryError
from swiftrun.runtime.core.undo import (
    GradCopies,
    StepRecord,
    UndoUnavailable,
    capture,
    invertible,
    state_bytes,
    undo_step,
    undoable,
)

PARAM_SIZES = (2048, 1500, 512)
# Weights of a typical layer scale; SGD's lr 0.01 and Adam's 1e-3 make updates of 1-30 % of that, large enough
# that the step crosses binades (and so loses bits) on a measurable share of elements.
PARAM_SCALE = 0.1
SGD_LR = 0.01
ADAM_LR = 1e-3

# Minimum share of parameter elements restored bit-exactly, per optimizer. The rest are elements whose step
# moved them into a larger binade: p_t then has half the resolution of p_{t-1} and two neighbouring values
# of p_{t-1} round to the same p_t, so the bit is gone. The share of those grows with |update| / |p|.
# Measured minimum over the grid below (torch 2.13, CPU): SGD 0.850 (Nesterov, whose update is largest),
# Adam and AdamW 0.963 (single-tensor and foreach) and 0.961 (fused).
MIN_BIT_EXACT = {"SGD": 0.83, "Adam": 0.95, "AdamW": 0.95}
# Largest error in ULPs of max(|p_{t-1}|, |p_t|). Measured: 0.5 for SGD, 1.0 for Adam/AdamW single-tensor and
# foreach, 3.0 for fused Adam/AdamW, whose kernel rounds the update differently from the ops undo replays (and
# may round differently again on other CPUs, hence the wider margin).
MAX_ULPS = 2.0
MAX_ULPS_FUSED = 8.0

IMPLEMENTATIONS: dict[str, dict[str, bool]] = {
    "single": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


# ------------------------------------------------------------------------------------------------ helpers

OptimizerClass = type[SGD] | type[Adam] | type[AdamW]
OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]


def typical(cls: OptimizerClass, **overrides: Any) -> OptimizerFactory:
    """A factory for ``cls`` with everyday settings: SGD with momentum, Adam and AdamW at their defaults."""
    config: dict[str, Any] = {"lr": SGD_LR, "momentum": 0.9} if cls is SGD else {"lr": ADAM_LR}
    return lambda params: cls(params, **{**config, **overrides})


def grad_of(param: nn.Parameter) -> torch.Tensor:
    assert param.grad is not None
    return param.grad


def make_params(seed: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter((torch.randn(n, generator=generator) * PARAM_SCALE).to(dtype)) for n in PARAM_SIZES]


def set_random_grads(params: list[nn.Parameter], generator: torch.Generator) -> None:
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)


@dataclass
class LastStep:
    """A trained optimizer, snapshots around its last step, and the record captured for that step."""

    params: list[nn.Parameter]
    optimizer: Optimizer
    grads: list[torch.Tensor]  # the last step's gradients, kept apart: a step may write into p.grad
    params_before: list[torch.Tensor]
    state_before: dict[int, dict[str, Any]]  # per parameter index: a deep copy of its optimizer state
    params_after: list[torch.Tensor]
    state_after: dict[int, dict[str, Any]]
    record: StepRecord


def snapshot_state(optimizer: Optimizer, params: list[nn.Parameter]) -> dict[int, dict[str, Any]]:
    return {i: copy.deepcopy(dict(optimizer.state[p])) for i, p in enumerate(params) if p in optimizer.state}


def take_steps(
    make_optimizer: OptimizerFactory,
    steps: int,
    *,
    copy_grads: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> LastStep:
    """Run ``steps`` optimizer steps with random gradients, capturing a record just before the last one."""
    params = make_params(seed, dtype)
    optimizer = make_optimizer(params)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps - 1):
        set_random_grads(params, generator)
        optimizer.step()
    set_random_grads(params, generator)
    params_before = [p.detach().clone() for p in params]
    state_before = snapshot_state(optimizer, params)
    grads = [grad_of(p).clone() for p in params]
    record = capture(optimizer, copy_grads=copy_grads)
    optimizer.step()
    return LastStep(
        params=params,
        optimizer=optimizer,
        grads=grads,
        params_before=params_before,
        state_before=state_before,
        params_after=[p.detach().clone() for p in params],
        state_after=snapshot_state(optimizer, params),
        record=record,
    )


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers at each |value| (float64 result)."""
    magnitude = values.abs().to(dtype)
    return (torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude).to(torch.float64)


def assert_params_restored_in_ulps(last: LastStep, min_bit_exact: float, max_ulps: float = MAX_ULPS) -> None:
    """Every element within ``max_ulps`` of max(|p_{t-1}|, |p_t|), and at least ``min_bit_exact`` of them exact."""
    exact = total = 0
    for restored, before, after in zip(last.params, last.params_before, last.params_after, strict=True):
        error = (restored.detach().to(torch.float64) - before.to(torch.float64)).abs()
        worst = (error / ulp(torch.maximum(before.abs(), after.abs()), before.dtype)).max().item()
        assert worst <= max_ulps, f"an element is {worst:.2f} ULPs off"
        exact += int((restored == before).sum())
        total += before.numel()
    assert exact / total >= min_bit_exact, f"only {exact / total:.4f} of the elements are bit-exact"


def assert_params_close(params: list[nn.Parameter], expected: list[torch.Tensor]) -> None:
    """Within rtol 1e-6, with an absolute floor of 1e-6 of the tensor's scale for elements near zero."""
    for param, value in zip(params, expected, strict=True):
        torch.testing.assert_close(param.detach(), value, rtol=1e-6, atol=1e-6 * value.abs().max().item())


def assert_params_restored(last: LastStep, min_bit_exact: float, max_ulps: float = MAX_ULPS) -> None:
    assert_params_close(last.params, last.params_before)
    assert_params_restored_in_ulps(last, min_bit_exact, max_ulps)


def redo(last: LastStep) -> None:
    """Take the last step again, with the gradients it used the first time."""
    for param, grad in zip(last.params, last.grads, strict=True):
        param.grad = grad.clone()
    last.optimizer.step()


def assert_state_matches(
    optimizer: Optimizer, params: list[nn.Parameter], expected: dict[int, dict[str, Any]]
) -> None:
    """Same parameters have state, same keys, exact step counters, tensors within 1e-6 of their scale.

    Elementwise relative error is not bounded: an entry of m or v much smaller than the gradient term the step
    added comes back through cancellation, a few ULPs of that term off.
    """
    actual = snapshot_state(optimizer, params)
    assert actual.keys() == expected.keys()
    for index, state in expected.items():
        assert actual[index].keys() == state.keys()
        for key, value in state.items():
            if key == "step":
                assert float(actual[index][key]) == float(value)
            else:
                tolerance = 1e-6 * max(value.abs().max().item(), 1e-30)
                torch.testing.assert_close(actual[index][key], value, rtol=1e-6, atol=tolerance)


def assert_unchanged(last: LastStep) -> None:
    """Parameters and state are bit-for-bit as right after the step (a refused undo wrote nothing)."""
    for param, after in zip(last.params, last.params_after, strict=True):
        assert torch.equal(param.detach(), after)
    actual = snapshot_state(last.optimizer, last.params)
    assert actual.keys() == last.state_after.keys()
    for index, state in last.state_after.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(actual[index][key]), torch.as_tensor(value))


# ------------------------------------------------------------------------------------------------ the grid


def sgd_configs() -> list[dict[str, Any]]:
    configs = []
    for weight_decay, momentum, dampening, nesterov, maximize, implementation in itertools.product(
        (0.0, 1e-4), (0.0, 0.9), (0.0, 0.1), (False, True), (False, True), IMPLEMENTATIONS
    ):
        if nesterov and (momentum == 0.0 or dampening != 0.0):
            continue  # torch rejects Nesterov without momentum or with dampening
        configs.append(
            dict(
                lr=SGD_LR, weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov,
                maximize=maximize, **IMPLEMENTATIONS[implementation],
            )
        )
    return configs


def adam_configs() -> list[dict[str, Any]]:
    return [
        dict(lr=ADAM_LR, betas=(beta1, 0.999), weight_decay=weight_decay, eps=eps, maximize=maximize,
             **IMPLEMENTATIONS[implementation])
        for beta1, weight_decay, eps, maximize, implementation in itertools.product(
            (0.9, 0.95), (0.0, 1e-2), (1e-8, 1e-9), (False, True), IMPLEMENTATIONS
        )
    ]


GRID = [
    pytest.param(cls, config, id=f"{cls.__name__}-{'-'.join(f'{k}={v}' for k, v in config.items() if k != 'lr')}")
    for cls, configs in ((SGD, sgd_configs()), (Adam, adam_configs()), (AdamW, adam_configs()))
    for config in configs
]


def step_creates_state(cls: OptimizerClass, config: dict[str, Any]) -> bool:
    return cls is not SGD or config["momentum"] != 0.0


@pytest.mark.parametrize("steps", [1, 2, 5])
@pytest.mark.parametrize(("cls", "config"), GRID)
def test_undo_restores_the_step_and_redo_reproduces_it(
    cls: OptimizerClass, config: dict[str, Any], steps: int
) -> None:
    last = take_steps(lambda params: cls(params, **config), steps)
    assert invertible(last.optimizer) == (True, "")
    assert undoable(last.optimizer, last.record) == (True, "")

    undo_step(last.optimizer, last.record)

    assert_params_restored(
        last, MIN_BIT_EXACT[cls.__name__], MAX_ULPS_FUSED if config.get("fused") else MAX_ULPS
    )
    assert_state_matches(last.optimizer, last.params, last.state_before)
    if steps == 1 and step_creates_state(cls, config):
        assert len(last.optimizer.state) == 0  # the first step's state is gone, not zeroed

    # Redo the same step: it must land where the original one did (and recreate a deleted state).
    redo(last)
    assert_params_close(last.params, last.params_after)
    assert_state_matches(last.optimizer, last.params, last.state_after)


# ------------------------------------------------------------------------------- hyperparameters and grads


@pytest.mark.parametrize(
    ("make_optimizer", "make_scheduler"),
    [
        pytest.param(
            lambda ps: SGD(ps, lr=SGD_LR, momentum=0.9, weight_decay=1e-4),
            lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1),
            id="SGD-StepLR",
        ),
        pytest.param(
            lambda ps: SGD(ps, lr=SGD_LR, momentum=0.9, nesterov=True, weight_decay=1e-4),
            lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),  # cycles momentum
            id="SGD-nesterov-OneCycleLR",
        ),
        pytest.param(
            lambda ps: Adam(ps, lr=ADAM_LR, weight_decay=1e-2),
            lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=10),  # cycles beta1
            id="Adam-OneCycleLR",
        ),
        pytest.param(
            lambda ps: AdamW(ps, lr=ADAM_LR, weight_decay=1e-2),
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1)),
            id="AdamW-LambdaLR",
        ),
    ],
)
def test_scheduler_step_after_the_step_does_not_change_the_undo(
    make_optimizer: OptimizerFactory,
    make_scheduler: Callable[[Optimizer], Any],
) -> None:
    def train_and_undo(scheduler_after_step: bool) -> LastStep:
        schedulers: list[Any] = []

        def build(params: list[nn.Parameter]) -> Optimizer:
            optimizer = make_optimizer(params)
            schedulers.append(make_scheduler(optimizer))
            return optimizer

        last = take_steps(build, steps=3)
        if scheduler_after_step:
            hyperparameters_before = copy.deepcopy([{**g, "params": None} for g in last.optimizer.param_groups])
            schedulers[0].step()
            changed = [{**g, "params": None} for g in last.optimizer.param_groups]
            assert changed != hyperparameters_before  # the scheduler really moved something the undo reads
        undo_step(last.optimizer, last.record)
        return last

    plain, scheduled = train_and_undo(False), train_and_undo(True)

    for with_scheduler, without in zip(scheduled.params, plain.params, strict=True):
        assert torch.equal(with_scheduler, without)
    assert_params_restored(scheduled, min_bit_exact=0.85)  # measured 0.88 (SGD) to 0.99 (Adam)
    assert_state_matches(scheduled.optimizer, scheduled.params, scheduled.state_before)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_reference_survives_zero_grad_set_to_none(cls: OptimizerClass) -> None:
    last = take_steps(typical(cls), steps=3, copy_grads=False)
    assert state_bytes(last.record) == 0

    last.optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in last.params)
    undo_step(last.optimizer, last.record)

    assert_params_restored(last, MIN_BIT_EXACT[cls.__name__])
    assert_state_matches(last.optimizer, last.params, last.state_before)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_kept_buffers_undo_like_a_clone_and_a_record_two_captures_old_refuses(cls: OptimizerClass) -> None:
    """GradCopies: the copy of capture n lives in a buffer kept from capture n-2. Undoing from it is bitwise
    undoing from a clone; the record whose buffer a later capture reused says so instead of inverting with
    another step's gradient."""
    params = make_params(0, torch.float32)
    optimizer = typical(cls, weight_decay=1e-4)(params)
    twin_params = [nn.Parameter(p.detach().clone()) for p in params]
    twin = typical(cls, weight_decay=1e-4)(twin_params)
    copies = GradCopies()
    generator = torch.Generator().manual_seed(1)
    records, buffers = [], []
    for _ in range(4):
        set_random_grads(params, generator)
        for p, q in zip(params, twin_params, strict=True):
            q.grad = grad_of(p).clone()
        records.append(capture(optimizer, copy_grads=True, copies=copies))
        twin_record = capture(twin, copy_grads=True)
        buffers.append([entry.grad for group in records[-1].groups for entry in group.params])
        optimizer.step()
        twin.step()
        for p in params:
            grad_of(p).mul_(3.0)  # the script changing p.grad afterwards touches none of the copies
    assert all(a is c for a, c in zip(buffers[1], buffers[3], strict=True))  # two buffers, in turn
    assert not any(a is b for a, b in zip(buffers[2], buffers[3], strict=True))
    assert state_bytes(records[-1]) == sum(n * 4 for n in PARAM_SIZES)
    assert undoable(optimizer, records[-1]) == (True, "")
    ok, reason = undoable(optimizer, records[1])  # its buffers hold capture 3's gradients now
    assert not ok and "reused by a later step" in reason
    undo_step(optimizer, records[-1])
    undo_step(twin, twin_record)
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
    for p, q in zip(params, twin_params, strict=True):
        for key, value in twin.state[q].items():
            assert torch.equal(torch.as_tensor(optimizer.state[p][key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_a_copy_is_immune_to_later_grad_changes(cls: OptimizerClass) -> None:
    by_reference = take_steps(typical(cls, weight_decay=1e-4), steps=3, copy_grads=False)
    by_copy = take_steps(typical(cls, weight_decay=1e-4), steps=3, copy_grads=True)
    assert state_bytes(by_copy.record) == sum(n * 4 for n in PARAM_SIZES)

    for param in by_copy.params:
        grad_of(param).mul_(2.0)  # the next backward accumulating, say: a reference would refuse (next test)
    undo_step(by_copy.optimizer, by_copy.record)
    undo_step(by_reference.optimizer, by_reference.record)

    for copied, referenced in zip(by_copy.params, by_reference.params, strict=True):
        assert torch.equal(copied, referenced)
    assert_params_restored(by_copy, MIN_BIT_EXACT[cls.__name__])


@pytest.mark.parametrize(
    "modify",
    [
        pytest.param(lambda grad: grad.zero_(), id="zero_"),
        pytest.param(lambda grad: grad.add_(1.0), id="accumulate"),
        pytest.param(lambda grad: grad.untyped_storage().resize_(0), id="freed"),
    ],
)
@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_reference_to_a_modified_grad_refuses_and_changes_nothing(
    cls: OptimizerClass, modify: Callable[[torch.Tensor], Any]
) -> None:
    last = take_steps(typical(cls), steps=3, copy_grads=False)
    modify(grad_of(last.params[-1]))  # only the last parameter: the first ones must not be undone either

    ok, reason = undoable(last.optimizer, last.record)
    assert not ok and "gradient" in reason  # the pre-check sees it too, without touching anything
    with pytest.raises(UndoUnavailable):
        undo_step(last.optimizer, last.record)
    assert_unchanged(last)


def test_foreach_nesterov_sgd_copies_the_grads_it_overwrites() -> None:
    # torch's foreach SGD adds momentum * buffer into p.grad itself when Nesterov runs without weight decay or
    # maximize, so a reference would hold the wrong gradient; capture copies them even with copy_grads=False.
    last = take_steps(lambda ps: SGD(ps, lr=SGD_LR, momentum=0.9, nesterov=True, foreach=True), steps=3)
    assert state_bytes(last.record) == sum(n * 4 for n in PARAM_SIZES)

    undo_step(last.optimizer, last.record)

    assert_params_restored(last, MIN_BIT_EXACT["SGD"])
    assert_state_matches(last.optimizer, last.params, last.state_before)


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_params_without_grad_are_left_alone(cls: OptimizerClass) -> None:
    params = make_params(seed=3)
    optimizer = typical(cls)(params)
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        set_random_grads(params, generator)
        optimizer.step()
    set_random_grads(params, generator)
    params[1].grad = None  # frozen for the last step: the step skips it, undo must too
    state_before = snapshot_state(optimizer, params)
    frozen = params[1].detach().clone()
    record = capture(optimizer, copy_grads=True)
    optimizer.step()

    undo_step(optimizer, record)

    assert torch.equal(params[1].detach(), frozen)
    assert_state_matches(optimizer, params, state_before)  # includes params[1]'s untouched step count


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_second_moment_that_was_zero_never_comes_back_negative(cls: OptimizerClass) -> None:
    # Elements whose gradient was 0 until the last step have v_{t-1} = 0 and v_t = (1-beta2) g^2 rounded to
    # float32; subtracting the float64 (1-beta2) g^2 leaves a residue of either sign, and a negative v would
    # make sqrt(v) of the redo NaN. Undo must clamp it.
    params = make_params(seed=5)
    optimizer = cls(params, lr=ADAM_LR)
    generator = torch.Generator().manual_seed(6)
    for _ in range(2):
        set_random_grads(params, generator)
        for param in params:
            grad_of(param)[: param.numel() // 2] = 0.0
        optimizer.step()
    set_random_grads(params, generator)
    record = capture(optimizer, copy_grads=False)
    optimizer.step()
    largest_after = [optimizer.state[param]["exp_avg_sq"].max().item() for param in params]

    undo_step(optimizer, record)

    for param, largest in zip(params, largest_after, strict=True):
        exp_avg_sq = optimizer.state[param]["exp_avg_sq"]
        assert (exp_avg_sq >= 0).all()
        # What is left of the zeros is a rounding error of the (1-beta2) g^2 the step added.
        assert exp_avg_sq[: param.numel() // 2].max() <= 1e-6 * largest
    optimizer.step()
    assert all(torch.isfinite(param).all() for param in params)


def test_param_groups_use_their_own_hyperparameters() -> None:
    def build(params: list[nn.Parameter]) -> Optimizer:
        return AdamW(
            [
                {"params": params[:1], "lr": 1e-2, "weight_decay": 0.1, "betas": (0.8, 0.99)},
                {"params": params[1:], "lr": 1e-3, "weight_decay": 0.0},
            ]
        )

    last = take_steps(build, steps=4)
    undo_step(last.optimizer, last.record)

    assert_params_restored(last, min_bit_exact=0.93)  # measured 0.952
    assert_state_matches(last.optimizer, last.params, last.state_before)


# Measured bit-exact shares (seeds 0-2, min): float64 SGD 0.827, Adam 0.981, AdamW 0.983 -- the inverse computes in
# float64 too, so for float64 parameters p_t + delta is itself rounded and there are no spare bits to absorb
# it; bfloat16 SGD 0.857, Adam and AdamW 0.991. float16 is left out: Adam's eps=1e-8 underflows to 0 in float16
# and the forward step itself produces infinities.
DTYPE_MIN_BIT_EXACT = {
    (torch.float64, SGD): 0.80, (torch.float64, Adam): 0.97, (torch.float64, AdamW): 0.97,
    (torch.bfloat16, SGD): 0.83, (torch.bfloat16, Adam): 0.98, (torch.bfloat16, AdamW): 0.98,
}


@pytest.mark.parametrize(("dtype", "cls"), list(DTYPE_MIN_BIT_EXACT), ids=str)
def test_other_parameter_dtypes(dtype: torch.dtype, cls: OptimizerClass) -> None:
    last = take_steps(typical(cls, weight_decay=1e-4, foreach=False), steps=3, dtype=dtype)
    undo_step(last.optimizer, last.record)

    assert all(param.dtype == dtype for param in last.params)
    # rtol 1e-6 is finer than bfloat16's resolution: the ULP bound is the meaningful check across dtypes.
    assert_params_restored_in_ulps(last, DTYPE_MIN_BIT_EXACT[dtype, cls])


# ------------------------------------------------------------------------------------------- refusals


class PlainGradientDescent(Optimizer):
    """A custom optimizer: invertible in principle, but undo cannot know its math."""

    def __init__(self, params: list[nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


class TweakedAdam(Adam):
    """A subclass of a supported optimizer: its step may differ, so it is not trusted."""


NOT_INVERTIBLE = [
    pytest.param(lambda ps: Adam(ps, amsgrad=True), "AMSGrad", id="Adam-amsgrad"),
    pytest.param(lambda ps: AdamW(ps, amsgrad=True), "AMSGrad", id="AdamW-amsgrad"),
    pytest.param(lambda ps: Adam(ps, betas=(0.0, 0.999)), "beta", id="Adam-beta1-0"),
    pytest.param(lambda ps: torch.optim.Adagrad(ps), "Adagrad", id="Adagrad"),
    pytest.param(lambda ps: torch.optim.RMSprop(ps), "RMSprop", id="RMSprop"),
    pytest.param(lambda ps: PlainGradientDescent(ps, lr=0.1), "PlainGradientDescent", id="custom"),
    pytest.param(lambda ps: TweakedAdam(ps), "TweakedAdam", id="Adam-subclass"),
]


@pytest.mark.parametrize(("make_optimizer", "named"), NOT_INVERTIBLE)
def test_non_invertible_optimizers_report_why_and_refuse(
    make_optimizer: OptimizerFactory, named: str
) -> None:
    last = take_steps(make_optimizer, steps=2)

    ok, reason = invertible(last.optimizer)
    assert not ok
    assert named in reason
    assert state_bytes(last.record) == 0  # nothing is kept for a step that cannot be undone
    with pytest.raises(UndoUnavailable, match=named):
        undo_step(last.optimizer, last.record)
    assert_unchanged(last)


def test_lbfgs_is_not_invertible() -> None:
    ok, reason = invertible(torch.optim.LBFGS(make_params(0)))
    assert not ok and "LBFGS" in reason


def test_differentiable_optimizers_are_not_invertible() -> None:
    ok, reason = invertible(SGD(make_params(0), lr=0.1, differentiable=True))
    assert not ok and "differentiable" in reason


def test_complex_params_are_not_invertible() -> None:
    ok, reason = invertible(Adam([nn.Parameter(torch.randn(4, dtype=torch.complex64))]))
    assert not ok and "complex" in reason


def test_sparse_grad_is_refused() -> None:
    param = nn.Parameter(torch.randn(8))
    optimizer = SGD([param], lr=0.1)
    param.grad = torch.randn(8).to_sparse()
    record = capture(optimizer, copy_grads=True)
    optimizer.step()
    with pytest.raises(UndoUnavailable, match="sparse"):
        undo_step(optimizer, record)


def test_fused_step_under_grad_scaler_is_refused() -> None:
    # GradScaler hands a fused optimizer grad_scale/found_inf for the duration of step(): the kernel unscales
    # the gradient itself and may skip the update, neither of which the record can see.
    param = nn.Parameter(torch.randn(8))
    optimizer = Adam([param], lr=ADAM_LR, fused=True)
    records: list[StepRecord] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: records.append(capture(opt, copy_grads=False)))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((param**2).sum()).backward()
    scaler.step(optimizer)

    assert invertible(optimizer) == (True, "")  # outside step() nothing betrays the scaler
    with pytest.raises(UndoUnavailable, match="AMP"):
        undo_step(optimizer, records[-1])


def test_undo_unavailable_is_a_recovery_error() -> None:
    assert issubclass(UndoUnavailable, RecoveryError)


def test_a_record_undoes_once() -> None:
    last = take_steps(lambda ps: SGD(ps, lr=SGD_LR, momentum=0.9), steps=3)
    undo_step(last.optimizer, last.record)
    restored = [p.detach().clone() for p in last.params]

    assert undoable(last.optimizer, last.record) == (False, "this step has already been undone")
    with pytest.raises(UndoUnavailable, match="already"):
        undo_step(last.optimizer, last.record)
    assert all(torch.equal(p, r) for p, r in zip(last.params, restored, strict=True))


def test_record_of_an_earlier_step_is_refused() -> None:
    # A stale record (the runtime missed a capture, say) must not roll Adam back with the wrong gradient: the
    # step counter shows the record is not of the last step.
    last = take_steps(lambda ps: Adam(ps, lr=ADAM_LR), steps=3)
    last.optimizer.step()
    last.params_after = [p.detach().clone() for p in last.params]
    last.state_after = snapshot_state(last.optimizer, last.params)

    with pytest.raises(UndoUnavailable, match="step count"):
        undo_step(last.optimizer, last.record)
    assert_unchanged(last)


def test_record_of_another_optimizer_is_refused() -> None:
    last = take_steps(lambda ps: Adam(ps, lr=ADAM_LR), steps=2)
    other = Adam(last.params, lr=ADAM_LR)
    with pytest.raises(UndoUnavailable, match="another optimizer"):
        undo_step(other, last.record)


def test_lr_times_weight_decay_of_one_has_no_inverse() -> None:
    last = take_steps(lambda ps: SGD(ps, lr=1.0, weight_decay=1.0), steps=2)
    with pytest.raises(UndoUnavailable, match="weight_decay"):
        undo_step(last.optimizer, last.record)
    assert_unchanged(last)


def test_capture_does_not_create_state_entries() -> None:
    params = make_params(0)
    optimizer = Adam(params)
    for param in params:
        param.grad = torch.ones_like(param)
    capture(optimizer, copy_grads=False)
    assert len(optimizer.state) == 0


# ---------------------------------------------------------------------------------------------- properties
#
# Over wide hyperparameter ranges a step can be as large as p itself, and the forward then rounds away more
# than the last bit of p_{t-1} or m_{t-1} (SGD rounds d = g + wd*p before scaling it by lr; lerp rounds g - m
# before weighting it), so the ULP bounds of the grid do not apply. What must hold anyway: parameters and
# state within 1e-6 of their scale, v never negative, and redoing the step lands within 1e-6 of p_t.


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 4),
    lr=st.floats(1e-4, 0.3),
    weight_decay=st.sampled_from([0.0, 1e-4, 1e-2, 0.1]),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    dampening=st.sampled_from([0.0, 0.1, 0.5]),
    nesterov=st.booleans(),
    maximize=st.booleans(),
)
def test_property_sgd_undo(
    seed: int, steps: int, lr: float, weight_decay: float, momentum: float, dampening: float, nesterov: bool,
    maximize: bool,
) -> None:
    nesterov = nesterov and momentum > 0 and dampening == 0.0
    config: dict[str, Any] = dict(
        lr=lr, weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov, maximize=maximize
    )
    last = take_steps(lambda params: SGD(params, **config), steps, seed=seed)
    undo_step(last.optimizer, last.record)
    assert_params_close(last.params, last.params_before)
    assert_state_matches(last.optimizer, last.params, last.state_before)
    redo(last)
    assert_params_close(last.params, last.params_after)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 4),
    decoupled=st.booleans(),
    lr=st.floats(1e-5, 1e-1),
    beta1=st.floats(0.5, 0.99),
    beta2=st.floats(0.9, 0.9999),
    eps=st.sampled_from([1e-6, 1e-8, 1e-10]),
    weight_decay=st.sampled_from([0.0, 1e-4, 1e-2, 0.1]),
    maximize=st.booleans(),
)
def test_property_adam_undo(
    seed: int, steps: int, decoupled: bool, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, maximize: bool,
) -> None:
    cls = AdamW if decoupled else Adam
    config: dict[str, Any] = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, maximize=maximize)
    last = take_steps(lambda params: cls(params, **config), steps, seed=seed)
    undo_step(last.optimizer, last.record)
    assert_params_close(last.params, last.params_before)
    for param in last.params:
        if param in last.optimizer.state:
            assert (last.optimizer.state[param]["exp_avg_sq"] >= 0).all()
    assert_state_matches(last.optimizer, last.params, last.state_before)
    redo(last)
    assert_params_close(last.params, last.params_after)
