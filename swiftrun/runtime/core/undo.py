"""Update-undo: invert the last optimizer step in place (Swift paper §3.3).

When a failure splits the survivors across an optimizer step, the ones that already applied step *t* roll it
back instead of everyone reloading a checkpoint. That is possible because, for SGD and Adam-family optimizers,
the parameter change of a step can be recomputed from the state the step *leaves behind* (momentum buffer,
first and second moments, step count), and every state update is affine in its previous value with a non-zero
coefficient. The only thing the step consumes and does not keep is the gradient, plus hyperparameters that a
scheduler may change afterwards; :func:`capture` records those just before ``optimizer.step()`` runs::

    optimizer.register_step_pre_hook(lambda opt, args, kwargs: runtime.remember(capture(opt, copy_grads)))
    ...
    undo_step(optimizer, last_record)      # parameters, state and step counters are as before the step

The inverse follows the forward math of torch's SGD, Adam and AdamW (single-tensor, foreach and fused
implementations compute the same formulas; fused rounds a little differently). It undoes the forward operations
in reverse order: first the parameter, from the post-step moments and the post-step count *t*; then, knowing
p_{t-1}, the L2-decayed gradient; then the moments. It computes in float64 and rounds back to the parameter
dtype at each point where the forward stored a value in that dtype, so most elements come back bit-exact and
the rest are a few ULP off.

A step that *created* a parameter's optimizer state (its first step) is undone by deleting that state, so that
redoing the step recreates it exactly as the first time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

from swiftrun.errors import RecoveryError

__all__ = [
    "AdamHyperparameters",
    "GroupStep",
    "ParamStep",
    "SGDHyperparameters",
    "StepRecord",
    "UndoUnavailable",
    "GradCopies",
    "capture",
    "invertible",
    "state_bytes",
    "undo_step",
    "undoable",
]


class UndoUnavailable(RecoveryError):
    """The last step cannot be inverted (optimizer not invertible, or what undo needs was overwritten)."""


@dataclass(frozen=True)
class SGDHyperparameters:
    """The SGD settings one step used, as Python numbers (a tensor lr is read at capture time)."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


@dataclass(frozen=True)
class AdamHyperparameters:
    """The Adam/AdamW settings one step used; ``decoupled_weight_decay`` is True for AdamW."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled_weight_decay: bool
    maximize: bool


Hyperparameters = SGDHyperparameters | AdamHyperparameters


@dataclass(frozen=True)
class ParamStep:
    """What the inverse needs about one parameter that had a gradient at step time."""

    param: torch.Tensor
    grad: torch.Tensor
    # ``grad._version`` at capture when ``grad`` is ``p.grad`` itself or a kept buffer of :class:`GradCopies` (a
    # later in-place change or reuse shows as a new version); None for a clone nothing else writes to.
    grad_version: int | None
    # Whether the parameter had optimizer state before the step; if not, the step created it.
    had_state: bool
    # Adam's step count before the step, when the counter lives on the CPU (reading a device counter would
    # cost a synchronisation on every training step); lets undo refuse a record that is not the last step.
    step_before: float | None
    # ``grad`` is a copy held for this record (a clone or a GradCopies buffer), not the script's ``p.grad``
    private: bool = False


class GradCopies:
    """Kept buffers that :func:`capture` copies gradients into, two per (optimizer, parameter) used in turn.

    The paper's gradient-sized copy, without a fresh allocation per step: cloning the gradients of two 512x512
    linear layers took 449 us on this CPU against 52 us for ``copy_`` into buffers kept from the step before
    (a fresh allocation pays its page faults every time; the stage checkpoint snapshot found the same). Two
    buffers because two records may be needed at once: the step in progress and the last completed one. The
    third capture reuses the first's buffer, which bumps that buffer's version, so a record that old fails
    :func:`undoable` with a reason instead of inverting a step with another step's gradient.
    """

    def __init__(self) -> None:
        # (optimizer, parameter) -> the parameter and its two buffers, the older first (the next to be reused)
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor | None]]] = {}

    def copy(self, optimizer: Optimizer, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        key = (id(optimizer), id(param))
        slot = self._slots.get(key)
        if slot is None or slot[0] is not param:  # an id reused by another tensor: start afresh
            slot = self._slots[key] = (param, [None, None])
        buffers = slot[1]
        buf = buffers.pop(0)
        if (buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype or buf.device != grad.device
                or buf.stride() != grad.stride()):
            buf = torch.empty_like(grad)
        with torch.no_grad():
            buf.copy_(grad)
        buffers.append(buf)
        return buf


@dataclass(frozen=True)
class GroupStep:
    """One parameter group: its hyperparameters at step time and the parameters the step updated."""

    hyperparameters: Hyperparameters
    params: tuple[ParamStep, ...]


@dataclass
class StepRecord:
    """Everything captured just before ``optimizer.step()`` that :func:`undo_step` needs.

    A record of a step that cannot be inverted holds no tensors and says why in ``unavailable_reason``; the
    capture hook never raises, so training goes on and only a later undo fails.
    """

    optimizer_id: int
    groups: tuple[GroupStep, ...]
    unavailable_reason: str | None = None
    # Set by a successful undo: the same record must not roll the optimizer back a second time.
    undone: bool = field(default=False, compare=False)


_SUPPORTED = (SGD, Adam, AdamW)


def invertible(optimizer: Optimizer) -> tuple[bool, str]:
    """(True, "") if undo_step can invert this optimizer's steps, else (False, human reason)."""
    kind = type(optimizer)
    if kind not in _SUPPORTED:
        if isinstance(optimizer, _SUPPORTED):
            return False, f"{kind.__name__} subclasses a supported optimizer but may change its step math"
        return False, (
            f"{kind.__module__}.{kind.__qualname__} has no inverse update "
            "(update-undo supports torch.optim.SGD, Adam and AdamW)"
        )
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        # Set by GradScaler for fused optimizers: the kernel unscales the gradient and may skip the step.
        return False, "the step runs under AMP grad scaling (grad_scale/found_inf), which undo does not model"
    for index, group in enumerate(optimizer.param_groups):
        where = f"param group {index}"
        if group.get("differentiable", False):
            return False, f"{where}: differentiable=True records the step in autograd, which cannot be undone"
        if any(torch.is_complex(p) for p in group["params"]):
            return False, f"{where}: complex parameters are not supported"
        if kind is not SGD:
            if group.get("amsgrad", False):
                return False, f"{where}: AMSGrad keeps a running max of v, which cannot be inverted"
            beta1, beta2 = (float(beta) for beta in group["betas"])
            if beta1 == 0.0 or beta2 == 0.0:
                return False, f"{where}: a beta of 0 discards the previous moment, which cannot be recovered"
    return True, ""


def capture(optimizer: Optimizer, copy_grads: bool, known_invertible: bool = False,
            copies: GradCopies | None = None) -> StepRecord:
    """Call right before optimizer.step() (the runtime uses optimizer.register_step_pre_hook).

    copy_grads=False keeps references to the p.grad tensors plus their ._version counters (zero extra memory;
    note that a reference keeps a gradient alive after ``zero_grad(set_to_none=True)`` until the next capture);
    copy_grads=True clones them (the paper's one gradient-sized buffer). A group whose step itself overwrites
    ``p.grad`` (foreach SGD with Nesterov, see :func:`_step_overwrites_grads`) is always copied.
    ``known_invertible``: the caller has just checked :func:`invertible` (it walks every parameter; a step's
    pre-hook need not pay for it twice). ``copies``: copy into these kept buffers instead of cloning.
    """
    ok, reason = (True, "") if known_invertible else invertible(optimizer)
    if not ok:
        return StepRecord(optimizer_id=id(optimizer), groups=(), unavailable_reason=reason)
    groups: list[GroupStep] = []
    for group in optimizer.param_groups:
        copy_group_grads = copy_grads or _step_overwrites_grads(optimizer, group)
        params: list[ParamStep] = []
        for param in group["params"]:
            grad = param.grad
            if grad is None:  # the step skips this parameter, and so does undo
                continue
            if grad.is_sparse:
                return StepRecord(
                    optimizer_id=id(optimizer), groups=(), unavailable_reason="sparse gradients are not supported"
                )
            # .get, not [...]: optimizer.state is a defaultdict and must not grow an entry here.
            state = optimizer.state.get(param, {})
            if not copy_group_grads:
                kept, version = grad, grad._version
            elif copies is not None:
                kept = copies.copy(optimizer, param, grad.detach())
                version = kept._version
            else:
                kept, version = grad.detach().clone(), None
            params.append(
                ParamStep(
                    param=param,
                    grad=kept,
                    grad_version=version,
                    had_state=_has_state(optimizer, state),
                    step_before=_cpu_step_count(state),
                    private=copy_group_grads,
                )
            )
        groups.append(GroupStep(hyperparameters=_hyperparameters(optimizer, group), params=tuple(params)))
    return StepRecord(optimizer_id=id(optimizer), groups=tuple(groups))


def state_bytes(record: StepRecord) -> int:
    """Extra memory the record holds (0 for references)."""
    return sum(
        entry.grad.numel() * entry.grad.element_size()
        for group in record.groups
        for entry in group.params
        if entry.private
    )


def undoable(optimizer: Optimizer, record: StepRecord) -> tuple[bool, str]:
    """(True, "") if :func:`undo_step` would succeed now, else (False, reason); changes nothing.

    Unlike :func:`invertible`, this also sees what happened since the capture (a gradient overwritten, a stale
    record), so a rank can report truthfully whether it can undo before anyone relies on it.
    """
    try:
        _check_undoable(optimizer, record)
    except UndoUnavailable as refusal:
        return False, str(refusal)
    return True, ""


def undo_step(optimizer: Optimizer, record: StepRecord) -> None:
    """Invert the step recorded in `record`, in place: parameters, optimizer state, step counters.

    Raises UndoUnavailable (and changes nothing) if not invertible or if a referenced gradient was modified
    in place since capture (its _version changed) or freed.
    """
    # Every check runs before the first write, so that a refusal leaves the optimizer exactly as it was.
    _check_undoable(optimizer, record)
    with torch.no_grad():
        for group in record.groups:
            for entry in group.params:
                if isinstance(group.hyperparameters, SGDHyperparameters):
                    _undo_sgd(optimizer, entry, group.hyperparameters)
                else:
                    _undo_adam(optimizer, entry, group.hyperparameters)
    record.undone = True


# --------------------------------------------------------------------------------------------- capture helpers


def _hyperparameters(optimizer: Optimizer, group: dict) -> Hyperparameters:
    if isinstance(optimizer, SGD):
        return SGDHyperparameters(
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )
    beta1, beta2 = group["betas"]
    return AdamHyperparameters(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        decoupled_weight_decay=isinstance(optimizer, AdamW) or bool(group.get("decoupled_weight_decay", False)),
        maximize=bool(group["maximize"]),
    )


def _step_overwrites_grads(optimizer: Optimizer, group: dict) -> bool:
    """Whether this group's step writes into ``p.grad``, so that a reference would not keep the applied gradient.

    torch's foreach SGD with Nesterov momentum adds ``momentum * buffer`` to the gradient list in place, and when
    neither weight decay nor maximize made a temporary copy first, that list *is* the ``p.grad`` tensors.
    ``foreach=None`` picks that implementation for parameters on an accelerator.
    """
    if not isinstance(optimizer, SGD) or not group["nesterov"]:
        return False
    if group["weight_decay"] != 0 or group["maximize"] or group.get("fused"):
        return False
    foreach = group.get("foreach")
    return foreach is True or (foreach is None and any(p.device.type != "cpu" for p in group["params"]))


def _has_state(optimizer: Optimizer, state: dict) -> bool:
    """Whether the step will find existing state for the parameter (and so will not create it)."""
    if isinstance(optimizer, SGD):
        return state.get("momentum_buffer") is not None
    return len(state) > 0  # Adam initialises all of its state lazily, when the entry is empty


def _cpu_step_count(state: dict) -> float | None:
    step = state.get("step")
    if step is None:
        return None
    if isinstance(step, torch.Tensor):
        return float(step) if step.device.type == "cpu" else None
    return float(step)


# ------------------------------------------------------------------------------------------------ validation


def _check_undoable(optimizer: Optimizer, record: StepRecord) -> None:
    if record.unavailable_reason is not None:
        raise UndoUnavailable(f"cannot undo the last step: {record.unavailable_reason}")
    if record.optimizer_id != id(optimizer):
        raise UndoUnavailable("the step record was captured from another optimizer")
    if record.undone:
        raise UndoUnavailable("this step has already been undone")
    for group in record.groups:
        hyper = group.hyperparameters
        decay_factor = 1.0 - hyper.lr * hyper.weight_decay
        if decay_factor == 0.0 and _decay_factor_divides(hyper):
            raise UndoUnavailable("lr * weight_decay == 1 maps every parameter to the same value; no inverse")
        for entry in group.params:
            _check_grad_intact(entry)
            state = optimizer.state.get(entry.param)
            if isinstance(hyper, SGDHyperparameters):
                if hyper.momentum != 0.0 and (state is None or state.get("momentum_buffer") is None):
                    raise UndoUnavailable("a parameter's momentum buffer is missing; was the step taken?")
            else:
                _check_adam_state(state, entry)


def _decay_factor_divides(hyper: Hyperparameters) -> bool:
    """Whether the inverse divides by (1 - lr * weight_decay) for these settings."""
    if isinstance(hyper, AdamHyperparameters):
        return hyper.decoupled_weight_decay
    # SGD with plain momentum recovers p_{t-1} from the buffer alone; the other variants solve for it.
    return hyper.momentum == 0.0 or hyper.nesterov


def _check_grad_intact(entry: ParamStep) -> None:
    grad = entry.grad
    needed_bytes = (grad.storage_offset() + grad.numel()) * grad.element_size()
    if grad.untyped_storage().nbytes() < needed_bytes:
        raise UndoUnavailable("the gradient of the last step has been freed")
    if entry.grad_version is not None and grad._version != entry.grad_version:
        if entry.private:
            raise UndoUnavailable("the copy of the last step's gradient was reused by a later step: the record is "
                                  "not of the last step")
        raise UndoUnavailable(
            "the gradient of the last step was modified in place since the step (zero_grad without "
            "set_to_none, or a new backward); capture with copy_grads=True to keep a private copy"
        )


def _check_adam_state(state: dict | None, entry: ParamStep) -> None:
    if state is None or not {"step", "exp_avg", "exp_avg_sq"} <= state.keys():
        raise UndoUnavailable("a parameter has no Adam state; was the step taken?")
    step_after = float(state["step"])
    step_before = entry.step_before if entry.had_state else 0.0
    if step_before is not None and step_after != step_before + 1:
        raise UndoUnavailable(
            f"a parameter's step count is {step_after:g}, expected {step_before + 1:g}: the record is not of the "
            "last step"
        )
    if step_after < 1:
        raise UndoUnavailable("a parameter's step count is below 1; there is no step to undo")


# ------------------------------------------------------------------------------------------------- inverses


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type torch's elementwise kernels compute in for tensors of ``dtype`` (half types compute in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel_scalar(value: float, dtype: torch.dtype) -> float:
    """``value`` as torch's kernels see a Python scalar operand (an ``alpha``, a ``mul_`` factor).

    The kernels round such a scalar to their compute type. Inverting with the rounded scalar, not the exact one,
    is what makes most elements come back bit-exact.
    """
    return float(torch.tensor(value, dtype=_compute_dtype(dtype)))


def _stored(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round a float64 intermediate to ``dtype`` and back, as the forward stored it between operations."""
    return value.to(dtype).to(torch.float64)


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    target.copy_(value.to(target.dtype))


def _applied_grad(entry: ParamStep, maximize: bool) -> torch.Tensor:
    grad = entry.grad.to(torch.float64)
    return -grad if maximize else grad


def _undo_sgd(optimizer: Optimizer, entry: ParamStep, hyper: SGDHyperparameters) -> None:
    """Invert ``d = g + wd*p; b = mu*b + (1-tau)*d (b = d on the first step); p -= lr*(d + mu*b | b | d)``."""
    param = entry.param
    dtype = param.dtype
    lr = _kernel_scalar(hyper.lr, dtype)
    grad = _applied_grad(entry, hyper.maximize)
    param_after = param.to(torch.float64)
    buffer_after = (
        optimizer.state[param]["momentum_buffer"].to(torch.float64) if hyper.momentum != 0.0 else None
    )

    if buffer_after is not None and not hyper.nesterov:
        # The update direction is the post-step buffer itself: no need to know p_{t-1}.
        param_before = _stored(param_after + lr * buffer_after, dtype)
    else:
        # The direction contains wd * p_{t-1}, so solve the linear equation for p_{t-1} ...
        undecayed = grad if buffer_after is None else grad + hyper.momentum * buffer_after
        estimate = _stored((param_after + hyper.lr * undecayed) / (1.0 - hyper.lr * hyper.weight_decay), dtype)
        # ... then rebuild the direction the forward computed, from that estimate and with its own rounding
        # (wd * p is small, so an estimate one ULP off almost always reproduces it exactly), and invert the
        # single ``p -= lr * direction`` instead, which is far more often bit-exact than the division.
        direction = _stored(grad + _kernel_scalar(hyper.weight_decay, dtype) * estimate, dtype)
        if buffer_after is not None:
            direction = _stored(direction + _kernel_scalar(hyper.momentum, dtype) * buffer_after, dtype)
        param_before = _stored(param_after + lr * direction, dtype)

    if buffer_after is not None:
        state = optimizer.state[param]
        if entry.had_state:
            decayed_grad = _stored(grad + _kernel_scalar(hyper.weight_decay, dtype) * param_before, dtype)
            buffer_before = (buffer_after - (1.0 - hyper.dampening) * decayed_grad) / hyper.momentum
            _write(state["momentum_buffer"], buffer_before)
        else:
            # The first step set b = d (no dampening); torch recreates it on the next step if it is absent.
            del state["momentum_buffer"]
            if not state:
                del optimizer.state[param]
    _write(param, param_before)


def _undo_adam(optimizer: Optimizer, entry: ParamStep, hyper: AdamHyperparameters) -> None:
    """Invert ``[p *= 1-lr*wd]; [g += wd*p]; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g^2; p -= lr/bc1 * m/denom``."""
    param = entry.param
    dtype = param.dtype
    state = optimizer.state[param]
    step_after = float(state["step"])  # t: the bias corrections use the post-step count

    # 1. p_{t-1} (before AdamW's decay) from the post-step moments. The delta is recomputed with the forward's
    # own operations: denom is stored in the parameter dtype after each op, as in the forward, and the quotient
    # is taken in the kernels' compute type, so the delta is bit-for-bit the one that was subtracted.
    bias_correction1 = 1.0 - hyper.beta1**step_after
    bias_correction2 = 1.0 - hyper.beta2**step_after
    denom = (state["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(hyper.eps)
    compute_dtype = _compute_dtype(dtype)
    delta = torch.zeros_like(param, dtype=compute_dtype).addcdiv_(
        state["exp_avg"].to(compute_dtype), denom.to(compute_dtype), value=hyper.lr / bias_correction1
    )
    param_before = _stored(param.to(torch.float64) + delta.to(torch.float64), dtype)
    exp_avg = state["exp_avg"].to(torch.float64)
    exp_avg_sq = state["exp_avg_sq"].to(torch.float64)

    # 2. Weight decay: AdamW scaled p first; Adam (L2) added wd * p_{t-1} to the gradient the moments saw.
    grad = _applied_grad(entry, hyper.maximize)
    if hyper.weight_decay != 0.0:
        if hyper.decoupled_weight_decay:
            param_before = _stored(param_before / _kernel_scalar(1.0 - hyper.lr * hyper.weight_decay, dtype), dtype)
        else:
            grad = _stored(grad + _kernel_scalar(hyper.weight_decay, dtype) * param_before, dtype)

    # 3. The moments, now that the gradient they absorbed is known.
    if entry.had_state:
        keep_fraction = 1.0 - (1.0 - hyper.beta1)  # lerp's (1 - weight), as torch computes the weight
        exp_avg_before = (exp_avg - (1.0 - hyper.beta1) * grad) / keep_fraction
        # The forward rounded (1-b2) g^2 into v_t in its own precision and this subtracts it in float64: where
        # v_{t-1} was 0 the residue has either sign, and a negative v would make sqrt(v) of the redo NaN.
        exp_avg_sq_before = ((exp_avg_sq - (1.0 - hyper.beta2) * grad * grad) / hyper.beta2).clamp_(min=0.0)
        _write(state["exp_avg"], exp_avg_before)
        _write(state["exp_avg_sq"], exp_avg_sq_before)
        _decrement(state)
    else:
        # The step created m, v and the counter; without them the redo initialises them exactly as before.
        del optimizer.state[param]
    _write(param, param_before)


def _decrement(state: dict) -> None:
    step = state["step"]
    if isinstance(step, torch.Tensor):
        step.sub_(1)  # in place: the tensor may be shared with a fused or captured (CUDA graph) step
    else:
        state["step"] = step - 1
