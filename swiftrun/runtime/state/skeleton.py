"""One walk over a tree of state: the containers, kept as they are, and the leaves, handed to a function.

Three parts of the runtime take a nested structure apart into a *skeleton* (the containers, with a placeholder
where each tensor was) plus the tensors, and put it back together: the state transfer to a replacement
(:mod:`swiftrun.runtime.state.transfer`), the stage checkpoints of a pipeline (:mod:`swiftrun.runtime.pp.ckpt`) and
the messages of a parallel replay (:mod:`swiftrun.runtime.pp.wire`); the step transaction copies trees the same
way (:mod:`swiftrun.runtime.core.txn`). They all walk with :func:`map_tree`, so a structure survives every one of
them alike. The rules:

- a ``dict`` is a container; a subclass is rebuilt from a shallow copy of itself, so it keeps its type and its
  attributes (``state_dict()`` returns an ``OrderedDict`` carrying ``_metadata``; a ``defaultdict`` keeps its
  factory);
- a ``list`` is a container; a subclass likewise;
- a ``tuple`` is a container: a namedtuple is rebuilt from its fields, any other subclass (``torch.Size``, a
  ``torch.return_types`` struct sequence) from the sequence of its items;
- ``None``, ``bool``, ``int``, ``float``, ``complex``, ``str`` and ``bytes`` are immutable atoms, kept as they are without a
  call to the leaf function; a tuple made only of atoms (Python's RNG state is 625 ints) is kept whole without a
  walk, which a stage checkpoint would otherwise pay for at every step that takes one;
- anything else (a tensor, a placeholder, an arbitrary object) is a leaf: the leaf function decides.

Walking into sets, dataclasses or arbitrary objects is deliberately not done: such a leaf travels as it is
(pickled whole), and its tensors with it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

Path = tuple[Any, ...]  # the keys and indices from the root to a leaf

ATOMS = frozenset((type(None), bool, int, float, complex, str, bytes))


def map_tree(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """``tree`` with every leaf replaced by ``leaf(value)``, every container rebuilt as the rules above say."""
    return _map(tree, lambda value, _path: leaf(value), None)


def map_tree_at(tree: Any, leaf: Callable[[Any, Path], Any], path: Path = ()) -> Any:
    """As :func:`map_tree`, ``leaf`` also receiving the leaf's path (``path`` prefixed)."""
    return _map(tree, leaf, path)


def leaves(tree: Any) -> Iterator[Any]:
    """The leaves of ``tree`` (atoms left out), in the order :func:`map_tree` visits them."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, (list, tuple)):
        if not (isinstance(tree, tuple) and _atomic(tree)):
            for value in tree:
                yield from leaves(value)
    elif type(tree) not in ATOMS:
        yield tree


def immutable(value: Any) -> bool:
    """A value nobody can change in place: an atom, or a plain tuple of atoms (Adam's betas), so that keeping a
    reference is keeping a copy. Exact types only: a subclass may carry mutable state."""
    kind = type(value)
    return kind in ATOMS or (kind is tuple and _atomic(value))


def _map(obj: Any, leaf: Callable[[Any, Path | None], Any], path: Path | None) -> Any:
    if isinstance(obj, dict):
        items = {k: _map(v, leaf, None if path is None else path + (k,)) for k, v in obj.items()}
        return items if type(obj) is dict else _refill_dict(obj, items)
    if isinstance(obj, list):
        items = [_map(v, leaf, None if path is None else path + (i,)) for i, v in enumerate(obj)]
        return items if type(obj) is list else _refill_list(obj, items)
    if isinstance(obj, tuple):
        if _atomic(obj):
            return obj
        items = [_map(v, leaf, None if path is None else path + (i,)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(items)
        if hasattr(obj, "_fields"):  # a namedtuple takes its fields as arguments, not one sequence
            return type(obj)(*items)
        return type(obj)(items)
    if type(obj) in ATOMS:
        return obj
    return leaf(obj, path)


def _atomic(items: tuple) -> bool:
    # the types are compared in C: a generator over 625 ints cost 60 us, for each of several walks per step
    return ATOMS.issuperset(map(type, items))


def _refill_dict(original: dict, items: dict) -> dict:
    try:
        out = copy.copy(original)  # keeps the subclass and its attributes
    except Exception:  # noqa: BLE001 - a subclass that cannot be copied travels as a plain dict
        return items
    out.clear()
    out.update(items)
    return out


def _refill_list(original: list, items: list) -> list:
    try:
        out = copy.copy(original)
    except Exception:  # noqa: BLE001 - as for dicts
        return items
    out[:] = items
    return out
