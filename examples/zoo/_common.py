"""What the zoo scripts share: distributed init, seeded batches, and ONE format for every rank's final state.

Each zoo script saves ``--save-dir/rank{r}.pt``: a flat ``dict[str, torch.Tensor]`` built by :func:`final_state`.
Two runs of the same configuration are the same training outcome exactly when these dicts are equal key by key
(``torch.equal``), so the fault campaign and the tests compare files without knowing the script. Keys:

``model.param.<name>``              every parameter of the (unwrapped) model
``model.buffer.<name>``             every buffer, non-persistent ones included (``named_buffers``, not state_dict)
``opt<i>.state.<p>.<key>``          optimizer state tensors (``p``: index of the parameter in the optimizer)
``opt<i>.group<j>.<hyper>``         lr, momentum, betas, weight_decay... of every param group (float64)
``sched<i>.<key>``                  numeric entries of the scheduler's state_dict (float64; lists flattened)
``scaler.<key>``                    GradScaler state (float64)
``<name>.param/buffer.<...>``       extra modules (the EMA model)
``extra.<key>``                     script-specific numbers (eval metric, counters)
``rng.torch``                       the global torch RNG state at the end (dropout/DataLoader seeding drift)
``step``                            the number of steps the loop ran
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn


def init_distributed() -> tuple[int, int]:
    """gloo on CPU under any launcher; without one (``python script.py``) a world of one on a HashStore, so the
    same DDP code path runs. Returns (rank, world size)."""
    if "RANK" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator that is a pure function of the seed and ``parts`` (step, rank, micro-batch...)."""
    value = seed
    for part in parts:
        value = (value * 1_000_003 + part) % (2**61 - 1)
    return torch.Generator().manual_seed(value)


class Samples(torch.utils.data.Dataset):
    """A fixed regression set drawn from ``seed`` (the custom Accelerate and Fabric loops): ``(x, tanh(sum of x's
    first 4 features))``."""

    def __init__(self, size: int, features: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, features, generator=g)
        self.y = torch.tanh(self.x[:, :4].sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def _number(value: Any) -> torch.Tensor | None:
    if isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, numbers.Number):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, numbers.Number) and not isinstance(v, bool) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def _add_numbers(out: dict[str, torch.Tensor], prefix: str, mapping: dict[str, Any]) -> None:
    for key, value in mapping.items():
        tensor = _number(value)
        if tensor is not None:
            out[f"{prefix}.{key}"] = tensor
        elif isinstance(value, dict):
            _add_numbers(out, f"{prefix}.{key}", value)


def _add_module(out: dict[str, torch.Tensor], prefix: str, module: nn.Module) -> None:
    for name, param in module.named_parameters():
        out[f"{prefix}.param.{name}"] = param.detach().cpu().clone()
    for name, buf in module.named_buffers():  # non-persistent buffers too
        out[f"{prefix}.buffer.{name}"] = buf.detach().cpu().clone()


def final_state(step: int, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
                schedulers: Iterable[Any] = (), scaler: Any = None, modules: dict[str, nn.Module] | None = None,
                extra: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out: dict[str, torch.Tensor] = {"step": torch.tensor(step, dtype=torch.int64)}
    _add_module(out, "model", module)
    for i, opt in enumerate(optimizers):
        index = {id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        for param, entries in opt.state.items():
            for key, value in entries.items():
                tensor = _number(value)
                if tensor is not None:
                    out[f"opt{i}.state.{index[id(param)]}.{key}"] = tensor
        for j, group in enumerate(opt.param_groups):
            for key, value in group.items():
                if key == "params":
                    continue
                tensor = _number(value)
                if tensor is not None:
                    out[f"opt{i}.group{j}.{key}"] = tensor
    for i, sched in enumerate(schedulers):
        _add_numbers(out, f"sched{i}", sched.state_dict())
    if scaler is not None:
        _add_numbers(out, "scaler", scaler.state_dict())
    for name, extra_module in (modules or {}).items():
        _add_module(out, name, extra_module)
    _add_numbers(out, "extra", extra or {})
    out["rng.torch"] = torch.get_rng_state()
    return out


def save_final(save_dir: str, rank: int, state: dict[str, torch.Tensor]) -> None:
    os.makedirs(save_dir, exist_ok=True)
    torch.save(state, os.path.join(save_dir, f"rank{rank}.pt"))


# ---------------------------------------------------------------------------------------------- comparison


def load(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def differing_keys(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors are not bitwise equal (or present in only one of the two)."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k], b[k])]


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: Iterable[str] | None = None) -> float:
    """Largest |a-b| / max|b| over the floating-point entries; inf when keys or shapes differ."""
    worst = 0.0
    for key in (keys if keys is not None else sorted(set(a) | set(b))):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            return math.inf
        x, y = a[key], b[key]
        if not (x.is_floating_point() and y.is_floating_point()):
            if not torch.equal(x, y):
                return math.inf
            continue
        x, y = x.double(), y.double()
        if x.numel() == 0:
            continue
        scale = max(y.abs().max().item(), 1e-12)
        worst = max(worst, (x - y).abs().max().item() / scale)
    return worst


def kind_of(key: str) -> tuple[str, str]:
    """The kind of a flat key: its path before the first index, and its leaf name.

    ``opt0.state.7.momentum_buffer`` is ("opt0.state", "momentum_buffer"): every parameter's momentum buffer;
    ``model.param.6.bias`` is ("model.param", "bias"): every layer's bias."""
    parts = key.split(".")
    first_index = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts))
    return ".".join(parts[:first_index]), parts[-1]


def kind_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: Iterable[str] | None = None) -> float:
    """Largest |a-b| of a floating-point entry over the largest magnitude of *its kind* in ``b`` (see kind_of).

    An inverted update is off by a few ULP of the values it handled, and training mixes those errors between
    tensors of the same kind. Dividing by one tensor's own magnitude would blow that up for a tensor that
    happens to be near zero at the end: the output bias's momentum, one element of 0.0066, was 1 ULP of 0.125
    (1.5e-8) off after an undo, "2.3e-6 relative" per tensor and 1.1e-7 of its kind (campaign seed 2 run 1).
    Integer entries must be equal (inf otherwise), like missing keys or different shapes."""
    scales: dict[tuple[str, str], float] = {}
    for key, value in b.items():
        if value.is_floating_point() and value.numel():
            kind = kind_of(key)
            scales[kind] = max(scales.get(kind, 0.0), value.double().abs().max().item())
    worst = 0.0
    for key in (keys if keys is not None else sorted(set(a) | set(b))):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            return math.inf
        x, y = a[key], b[key]
        if not (x.is_floating_point() and y.is_floating_point()):
            if not torch.equal(x, y):
                return math.inf
            continue
        if x.numel() == 0:
            continue
        scale = max(scales.get(kind_of(key), 0.0), 1e-12)
        worst = max(worst, (x.double() - y.double()).abs().max().item() / scale)
    return worst
