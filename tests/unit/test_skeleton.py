"""One tensor-tree walk (runtime/state/skeleton.py) for transfer, stage checkpoints, the replay wire and the step
transaction: a structure comes back from each of them with the same containers it went in with."""

from __future__ import annotations

import pickle
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from swiftrun.runtime.core.txn import Copier
from swiftrun.runtime.pp import wire
from swiftrun.runtime.pp.ckpt import FlatSnapshots
from swiftrun.runtime.state import skeleton
from swiftrun.runtime.state import transfer as T

Pair = namedtuple("Pair", ["first", "second"])  # module level: a stage checkpoint's skeleton is pickled


class Tagged(list):
    """A list subclass with an attribute, like a user's container."""


def a_tree() -> dict:
    ordered = OrderedDict(w=torch.arange(6.0).reshape(2, 3), b=torch.ones(3))
    ordered._metadata = {"": {"version": 1}}  # what Module.state_dict() returns carries this
    counts = defaultdict(int, seen=torch.tensor([3, 4]))
    tagged = Tagged([torch.full((2,), 7.0), "label"])
    tagged.note = "kept"
    return {
        "state_dict": ordered,
        "pair": Pair(torch.zeros(2, 2), (torch.ones(4), 5)),
        "size": torch.Size([2, 3]),
        "rng": tuple(range(625)),
        "counts": counts,
        "tagged": tagged,
        "scalar": torch.tensor(2.5),
        "none": None,
    }


def assert_same_structure(got, want) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        assert getattr(got, "__dict__", {}).keys() == getattr(want, "__dict__", {}).keys()
        if isinstance(want, defaultdict):
            assert got.default_factory is want.default_factory
        for key in want:
            assert_same_structure(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        if isinstance(want, Tagged):
            assert got.note == want.note
        for g, w in zip(got, want):
            assert_same_structure(g, w)
    else:
        assert got == want


def test_map_tree_keeps_every_container_and_calls_leaf_only_for_non_atoms():
    tree = a_tree()
    seen = []
    out = skeleton.map_tree(tree, lambda leaf: seen.append(leaf) or leaf)
    assert_same_structure(out, tree)
    assert all(not isinstance(leaf, (int, float, str, bytes, type(None))) for leaf in seen)
    assert sum(isinstance(leaf, torch.Tensor) for leaf in seen) == 7
    assert out["rng"] is tree["rng"]  # a tuple of atoms is kept whole, not walked


def test_leaves_follow_map_tree_order_and_paths_name_each_leaf():
    tree = a_tree()
    visited = []
    skeleton.map_tree(tree, lambda leaf: visited.append(leaf) or leaf)
    assert [id(x) for x in skeleton.leaves(tree)] == [id(x) for x in visited]
    paths = []
    skeleton.map_tree_at(tree, lambda leaf, path: paths.append(path) or leaf, ("root",))
    assert ("root", "pair", 1, 0) in paths and ("root", "state_dict", "w") in paths


def test_the_replay_wire_carries_a_namedtuple():
    # the wire's own walker rebuilt containers with type(value)(generator): a namedtuple raised TypeError
    message = {"args": (Pair(torch.ones(2), torch.zeros(3)),), "mbs": [Pair(1, torch.arange(4))]}
    tensors: list[torch.Tensor] = []
    lifted = wire._lift(message, tensors)
    header = pickle.loads(pickle.dumps(lifted))
    back = wire._drop(header, {slot.index: tensors[slot.index].clone() for slot in wire._slots(header)})
    assert_same_structure(back, message)
    assert_same_structure(wire.cpu(message), message)
    assert_same_structure(wire.to(message, torch.device("cpu")), message)


def test_a_stage_checkpoint_keeps_namedtuples_and_state_dict_metadata():
    tree = a_tree()
    packed, ready = FlatSnapshots().take(tree)
    ready()
    back = packed.unpack()
    assert_same_structure(back, tree)
    assert back["state_dict"]._metadata == {"": {"version": 1}}
    # the namedtuple's tensors went into the flat buffer (copies), not into the pickled skeleton
    assert back["pair"].first.data_ptr() != tree["pair"].first.data_ptr()


def test_the_transfer_skeleton_keeps_namedtuples_and_subclasses():
    tree = a_tree()
    header, sources = T.encode(tree, torch.device("cpu"), 64)
    problem, rebuilt, targets, _, _ = T._resolve(header["tree"], header["specs"], torch.device("cpu"), None)
    assert problem is None
    for source, dests in zip(sources, targets):
        for dest in dests:
            dest.copy_(source)
    assert_same_structure(rebuilt, tree)


def test_the_step_transaction_copies_keep_containers_and_reuse_buffers():
    copier = Copier()
    tree = {"lr": Pair(torch.tensor([0.1, 0.2]), 3), "hist": [torch.ones(2)]}
    first = copier.freeze(tree, "u")
    assert_same_structure(first, tree)
    tree["hist"][0].add_(1)
    second = copier.freeze(tree, "u")
    assert second["hist"][0] is first["hist"][0]  # same path, shape, dtype: the kept buffer, refilled
    assert torch.equal(second["hist"][0], torch.full((2,), 2.0))


@pytest.mark.parametrize("tree", [torch.ones(3), 7, None, "text"])
def test_a_bare_leaf_is_its_own_tree(tree):
    out = skeleton.map_tree(tree, lambda leaf: leaf)
    assert out is tree
