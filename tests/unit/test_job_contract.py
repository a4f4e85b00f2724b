"""Both jobs an agent's loop can drive keep the declared contract (``swiftrun/launcher/contract.py``).

The loop in ``launcher/agent.py`` is written once; on one node it drives the local ``Job``, on a node of a
multi-node job the ``RemoteJob`` that forwards to the coordinator. A method one of them lacks, or takes with other
parameters, would break the other mode at run time only, in a multi-node test or a user's job.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from swiftrun.config import Entrypoint, EntrypointKind, LaunchConfig
from swiftrun.launcher.contract import SupervisedJob, SupervisedSlot
from swiftrun.launcher.job import Job, Slot
from swiftrun.launcher.node_agent import MirrorSlot, RemoteJob

pytestmark = pytest.mark.timeout(30)


def _config() -> LaunchConfig:
    return LaunchConfig(entrypoint=Entrypoint(kind=EntrypointKind.SCRIPT, target="train.py"), nproc_per_node=2)


def _jobs() -> list[Any]:
    sent: list[Any] = []
    return [Job(_config(), 0.0), RemoteJob(_config(), lambda kind, data: sent.append((kind, data)), 0.0)]


def _contract_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(SupervisedJob).items()
        if callable(member) and not name.startswith("_")
    }


def _members(protocol: type) -> set[str]:
    own = set(vars(protocol)) | set(getattr(protocol, "__annotations__", {}))
    return {name for name in own if not name.startswith("_")}


def test_the_contract_names_what_the_loop_calls() -> None:
    """Every ``self.job.X`` in the agent's loop is in the contract, except the local Job's own ``start``."""
    source = (Path(__file__).parents[2] / "swiftrun" / "launcher" / "agent.py").read_text()
    import re

    used = set(re.findall(r"self\.job\.([a-z_]+)", source))
    assert used, "the agent's loop no longer drives self.job?"
    assert used - _members(SupervisedJob) == set()


@pytest.mark.parametrize("job", _jobs(), ids=["Job", "RemoteJob"])
def test_both_jobs_have_every_member(job: Any) -> None:
    assert isinstance(job, SupervisedJob)
    for name in _members(SupervisedJob):
        assert hasattr(job, name), f"{type(job).__name__} lacks {name}"


@pytest.mark.parametrize("cls", [Job, RemoteJob])
def test_both_jobs_take_the_contracts_parameters(cls: type) -> None:
    for name, wanted in _contract_methods().items():
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(wanted.parameters), f"{cls.__name__}.{name}{got} != {wanted}"
        for param in wanted.parameters.values():
            assert got.parameters[param.name].default == param.default, f"{cls.__name__}.{name}: {param.name}"


@pytest.mark.parametrize("cls", [Slot, MirrorSlot])
def test_both_slots_carry_what_the_loop_reads(cls: type) -> None:
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    assert _members(SupervisedSlot) <= fields, f"{cls.__name__} lacks {_members(SupervisedSlot) - fields}"


def test_a_remote_job_answers_the_loop_as_the_local_one_does() -> None:
    """The same calls in the same order, on both: every answer is a list of actions, never None."""
    for job in _jobs():
        if isinstance(job, RemoteJob):
            job.accepted = True
            job.slots[0] = MirrorSlot(0, 0, 0, 0.0)
        else:
            job.start(0.0)
        answers = [
            job.on_spawned(0, 1234, 0.1),
            job.on_hello(0, 0, 0.2),
            job.on_alive(0, 0.3, 1),
            job.tick(0.4),
            job.drain_records(),
        ]
        assert all(isinstance(answer, list) for answer in answers), type(job).__name__
        assert isinstance(job.next_deadline(0.5), float) and isinstance(job.silent_slots(0.5), list)
