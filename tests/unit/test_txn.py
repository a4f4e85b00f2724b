"""A step is a transaction: what a step changes outside the optimizer update is put back exactly."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from swiftrun.runtime.state.registry import Registry, RegistrationError, plain, unwrap
from swiftrun.runtime.core.precopy import PreStepCopy
from swiftrun.runtime.core.txn import Transaction

pytestmark = pytest.mark.timeout(60)


def _setup(user=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model.register_buffer("calls", torch.zeros(()), persistent=False)  # a non-persistent counter
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.5}],
                          lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20)
    reg = Registry.build(model, [opt], [sched], None, user)
    return model, opt, sched, reg


def _train_step(model, opt, sched):
    opt.zero_grad()
    model.calls += 1
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    sched.step()


def _everything(model, opt, sched):
    out = {f"t.{k}": v.clone() for k, v in model.state_dict().items()}
    out.update({f"b.{k}": v.clone() for k, v in model.named_buffers()})
    out.update({f"lr{i}": torch.tensor(g["lr"]) for i, g in enumerate(opt.param_groups)})
    out.update({f"mom{i}": torch.tensor(g["momentum"]) for i, g in enumerate(opt.param_groups)})
    out["sched"] = torch.tensor(sched.last_epoch)
    return out


def test_restore_puts_back_buffers_hyperparameters_and_schedulers_a_step_changed():
    model, opt, sched, reg = _setup()
    for _ in range(3):
        _train_step(model, opt, sched)
    txn = Transaction(reg)
    snap = txn.begin(3)
    # only side effects are restored; parameters are the optimizer's business: snapshot them for the check
    before = {k: v for k, v in _everything(model, opt, sched).items()}
    params = [p.detach().clone() for p in model.parameters()]
    _train_step(model, opt, sched)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params):
            p.copy_(saved)
    txn.restore(snap)
    after = _everything(model, opt, sched)
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_snapshots_reuse_their_buffers_and_keep_as_many_steps_as_asked():
    model, opt, sched, reg = _setup()
    txn = Transaction(reg, keep=2)
    first = txn.begin(0)
    _train_step(model, opt, sched)
    second = txn.begin(1)
    assert txn.snapshot(0) is first and txn.snapshot(1) is second
    _train_step(model, opt, sched)
    third = txn.begin(2)
    assert txn.snapshot(0) is None and txn.snapshot(2) is third
    assert third.buffers[0]["1.running_mean"].data_ptr() == first.buffers[0]["1.running_mean"].data_ptr()


def test_rng_of_the_step_is_kept():
    _, _, _, reg = _setup()
    txn = Transaction(reg)
    torch.manual_seed(5)
    random.seed(5)
    txn.begin(7)
    expected = (torch.rand(3), random.random())
    from swiftrun.runtime.core.txn import set_rng_state

    set_rng_state(txn.rng_for(7))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert txn.rng_for(6) is None


def test_user_state_dict_and_module_are_restored():
    ema = torch.optim.swa_utils.AveragedModel(nn.Linear(3, 3))
    model, opt, sched, reg = _setup(user=ema)
    txn = Transaction(reg)
    snap = txn.begin(0)
    saved = {k: v.clone() for k, v in ema.state_dict().items()}
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(1.0)
    txn.restore(snap)
    assert all(torch.equal(saved[k], v) for k, v in ema.state_dict().items())

    counters = {"seen": 3}
    _, _, _, reg = _setup(user=counters)
    txn = Transaction(reg)
    snap = txn.begin(0)
    counters["seen"] = 4
    txn.restore(snap)
    assert counters == {"seen": 3}


def test_writes_to_parameters_outside_the_optimizer_are_noticed():
    model, _, _, reg = _setup()
    txn = Transaction(reg)
    txn.begin(0)
    assert not txn.params_touched()
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # e.g. an in-place all-reduce averaging the parameters
    assert txn.params_touched()


def test_registry_unwraps_compile_and_ddp_and_refuses_duplicates():
    module = nn.Linear(2, 2)

    class Wrapper(nn.Module):  # what torch.compile returns keeps the original in _orig_mod
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    assert unwrap(Wrapper(module)) is module
    assert plain(Wrapper(module)) is module
    with pytest.raises(RegistrationError, match="twice"):
        Registry.build([module, Wrapper(module)], [], [], None, None)
    with pytest.raises(RegistrationError, match="nn.Module"):
        Registry.build("model", [], [], None, None)


def _optimizer_state(model, opt):
    out = {f"p.{name}": p.detach().clone() for name, p in model.named_parameters()}
    for index, p in enumerate(model.parameters()):
        for key, value in opt.state.get(p, {}).items():
            out[f"s.{index}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adagrad(ps, lr=0.05),  # no arithmetic inverse at all
], ids=["momentum", "adamw", "adagrad"])
def test_pre_step_copy_undoes_a_step_bitwise_and_a_first_step_recreates_the_state(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = make(list(model.parameters()))
    copy = PreStepCopy()

    def grads():
        opt.zero_grad(set_to_none=True)
        model(torch.randn(16, 4)).pow(2).mean().backward()

    grads()
    copy.take(opt, 0)
    first_keys = {k for p in model.parameters() for k in opt.state.get(p, {})}
    opt.step()
    copy.restore(opt)
    # SGD and Adam create their state in the first step: gone again, so the redo recreates it the same way
    # (Adagrad creates it in its constructor, and it is put back like any other)
    assert {k for p in model.parameters() for k in opt.state.get(p, {})} == first_keys
    opt.step()
    for step in range(1, 4):
        grads()
        before = _optimizer_state(model, opt)
        copy.take(opt, step)
        held = {id(v) for p in model.parameters() for v in opt.state[p].values()}
        opt.step()
        assert _optimizer_state(model, opt).keys() == before.keys()
        assert not all(torch.equal(v, _optimizer_state(model, opt)[k]) for k, v in before.items())
        copy.restore(opt)
        after = _optimizer_state(model, opt)
        assert after.keys() == before.keys()
        for key, value in before.items():
            assert torch.equal(after[key], value), key  # bitwise, where the arithmetic inverse is a few ULP off
        # written in place: a fused or compiled step may hold on to the very tensors
        assert {id(v) for p in model.parameters() for v in opt.state[p].values()} == held
        assert copy.step is None  # spent
        opt.step()


def test_pre_step_copy_reuses_its_buffers():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    copy = PreStepCopy()
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        copy.take(opt, step)
        if step == 1:
            kept = {id(t) for t in copy._copier._buffers.values()}
        opt.step()
    assert {id(t) for t in copy._copier._buffers.values()} == kept
    assert copy.nbytes() == 2 * sum(p.numel() * p.element_size() for p in model.parameters())  # params + momentum


def _same_numpy_state(a, b):
    import numpy as np

    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_numpy_state_read_cheaply_is_always_the_full_state():
    """The reader reuses its last full read only while NumPy's raw generator state is unchanged and the Gaussian
    cache was empty: after every kind of use it must equal np.random.get_state() exactly."""
    np = pytest.importorskip("numpy")
    from swiftrun.runtime.core.txn import NumpyGlobalState

    np.random.seed(3)
    reader = NumpyGlobalState(np.random)
    assert reader.address is not None  # the raw layout was recognised (else every read is a full one)
    first = reader()
    assert reader() is first  # nothing drawn: the full read is reused
    uses = [
        lambda: np.random.random(3),
        lambda: np.random.standard_normal(1),  # fills the Gaussian cache
        lambda: np.random.standard_normal(1),  # consumes it: the raw state does not move
        lambda: None,
        lambda: np.random.randint(0, 10, size=624),  # a whole key regeneration
        lambda: np.random.seed(3),
        lambda: np.random.set_state(first),
        lambda: np.random.shuffle(list(range(5))),
    ]
    for use in uses:
        use()
        assert _same_numpy_state(reader(), np.random.get_state())
    np.random.standard_normal(1)
    cached = np.random.get_state()
    assert cached[3] == 1 and reader() is not reader()  # a full cache is read in full every time
    fallback = NumpyGlobalState(np.random)
    fallback.address = None
    assert _same_numpy_state(fallback(), np.random.get_state())


def test_rng_state_restores_numpy_python_and_torch_bitwise():
    np = pytest.importorskip("numpy")
    from swiftrun.runtime.core.txn import rng_state, set_rng_state

    np.random.seed(1)
    np.random.standard_normal(1)  # a cached Gaussian travels too
    saved = rng_state()
    expected = (np.random.standard_normal(3), random.random(), torch.rand(2))
    np.random.random(7)
    random.random()
    torch.rand(5)
    set_rng_state(saved)
    again = (np.random.standard_normal(3), random.random(), torch.rand(2))
    assert np.array_equal(expected[0], again[0]) and expected[1] == again[1] and torch.equal(expected[2], again[2])


def test_one_walk_finds_the_buffers_and_version_counters_named_buffers_and_parameters_give():
    from swiftrun.runtime.core.txn import buffers_and_versions

    shared = nn.BatchNorm1d(3)
    model = nn.Sequential(nn.Linear(3, 3), shared, nn.Sequential(shared, nn.Linear(3, 3)))
    model.register_buffer("none", None)
    model[2][1].weight = model[0].weight  # a shared parameter counts once
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[2][1].bias.mul_(2.0)
    found, versions = buffers_and_versions(model)
    assert list(found) == [name for name, _ in model.named_buffers()]
    assert all(found[name] is buf for name, buf in model.named_buffers())
    assert versions == sum(p._version for p in model.parameters()) > 0


def test_settings_keep_immutable_values_by_reference_and_copy_the_rest():
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), betas=(0.9, 0.99))
    opt.param_groups[0]["custom"] = [1, 2]
    reg = Registry.build(model, [opt], [], None, None)
    txn = Transaction(reg)
    snap = txn.begin(0)
    saved = snap.hyperparameters[0][0]
    group = opt.param_groups[0]
    assert saved["betas"] is group["betas"] and saved["eps"] is group["eps"]
    assert saved["lr"] is not group["lr"] and saved["custom"] is not group["custom"]
    group["lr"].fill_(0.5)
    group["custom"].append(3)
    group["betas"] = (0.5, 0.5)
    txn.restore(snap)
    assert float(group["lr"]) == pytest.approx(0.01) and group["custom"] == [1, 2] and group["betas"] == (0.9, 0.99)
