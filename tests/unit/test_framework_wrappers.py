"""swiftrun.Run takes the objects Accelerate's prepare() returns: the registry sees the torch objects inside.

Real Accelerate objects, in one process on the CPU (Accelerator without a distributed launch wraps no DDP)."""

from __future__ import annotations

import pytest
import torch

from swiftrun.runtime.state.registry import Registry, unwrap_framework

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def prepared():
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    accelerator = accelerate.Accelerator(cpu=True)
    yield (model, opt, sched) + tuple(accelerator.prepare(model, opt, sched))
    AcceleratorState._reset_state(True)  # a process-wide singleton: leave none behind for other tests
    GradientState._reset_state()


def test_prepared_optimizer_and_scheduler_are_registered_as_the_torch_objects_inside(prepared):
    model, opt, sched, p_model, p_opt, p_sched = prepared
    assert type(p_opt).__name__ == "AcceleratedOptimizer" and type(p_sched).__name__ == "AcceleratedScheduler"
    reg = Registry.build(p_model, [p_opt], [p_sched], None, None)
    assert reg.optimizers == [opt] and reg.schedulers == [sched] and reg.models == [model]


def test_a_hook_on_the_registered_optimizer_fires_when_the_script_steps_the_prepared_one(prepared):
    # why unwrapping matters: the runtime's undo records come from hooks on the registered optimizer
    _, _, _, p_model, p_opt, p_sched = prepared
    reg = Registry.build(p_model, [p_opt], [p_sched], None, None)
    fired = []
    reg.optimizers[0].register_step_pre_hook(lambda *_: fired.append("pre"))
    p_model(torch.ones(3, 4)).sum().backward()
    p_opt.step()
    p_sched.step()
    assert fired == ["pre"]
    assert reg.schedulers[0].last_epoch == 1


def test_prepared_wrappers_of_registered_objects_are_neither_warned_about_nor_compared_as_unregistered(prepared):
    # the wrapper lives on the heap beside the optimizer it wraps: it once read as an unregistered optimizer, so
    # Run() warned and every recovery of an HF Trainer job was refused ("replicas differ after the recovery")
    from swiftrun.runtime.state import verify

    _, opt, _, p_model, p_opt, p_sched = prepared
    reg = Registry.build(p_model, [p_opt], [p_sched], None, None)
    assert verify.registration_warnings(reg) == []
    assert not [k for k in verify.unregistered_digests(reg) if "Accelerated" in k]
    bare = Registry.build(p_model, [], [], None, None)  # nothing registered: the wrapper is still said
    assert any("AcceleratedOptimizer" in w for w in verify.registration_warnings(bare))


def test_the_accelerators_micro_batch_count_travels_and_is_restored_with_the_user_state(prepared):
    # accelerator.accumulate() synchronises gradients at every n-th micro-batch it counts: a redone window must
    # count from its start's count, a replacement from its replica's. The Accelerator is found where a script
    # holds it (a local of a frame on the stack), as no prepared object points back at it
    _, _, _, p_model, p_opt, p_sched = prepared
    accelerator = accelerate.Accelerator(cpu=True)  # the process-wide state is shared with the fixture's
    reg = Registry.build(p_model, [p_opt], [p_sched], None, {"ema_steps": 3})
    assert [holder for holder, _ in reg.counters] == [accelerator] and reg.has_user_state
    accelerator.step = 7
    saved = reg.user_state_dict()
    assert saved == {"script": {"ema_steps": 3}, "counters": [{"step": 7}]}
    accelerator.step = 9
    reg.load_user_state(saved)
    assert accelerator.step == 7 and reg.user_state == {"ema_steps": 3}
    plain_reg = Registry.build(torch.nn.Linear(1, 1), [], [], None, {"a": 1})  # no Accelerate: format unchanged
    assert plain_reg.counters == [] and plain_reg.user_state_dict() == {"a": 1}


def test_a_class_of_the_same_name_from_another_package_is_left_alone():
    class AcceleratedOptimizer:  # noqa: N801 - the name is the point
        optimizer = "inner"

    obj = AcceleratedOptimizer()
    assert unwrap_framework(obj) is obj


def test_plain_torch_objects_are_unchanged():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert unwrap_framework(model) is model and unwrap_framework(opt) is opt


def test_compile_and_framework_wrappers_are_stripped_in_either_order():
    # a stand-in with Fabric's class name and package (lightning is not a test dependency): a compiled Fabric
    # module around a DDP-less model, and a Fabric module around a compiled model, both register the model itself
    fabric_module = type("_FabricModule", (torch.nn.Module,), {"__module__": "lightning.fabric.wrappers"})

    def wrap(inner: torch.nn.Module) -> torch.nn.Module:
        outer = fabric_module()
        outer._forward_module = inner
        return outer

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for wrapped in (torch.compile(wrap(model)), wrap(torch.compile(model))):
        assert Registry.build(wrapped, [opt], [], None, None).models == [model]
