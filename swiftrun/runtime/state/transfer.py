"""Streaming broadcast of a nested state tree in bounded chunks.

The source turns its tree into a *skeleton*: the same containers with every streamed tensor replaced by a
:class:`_Slot` and every other leaf (scalars, strings, small tensors, arbitrary objects) kept inline. The
skeleton, the tensors' specs (shape, dtype, device kind) and the chunk size go in one
``dist.broadcast_object_list``. Every rank then derives the same :func:`plan_chunks` from the specs: a list of
chunks, each a list of pieces ``(tensor, first element, last element, byte offset)``; several small tensors
share a chunk and a large one spans several. For each chunk the source copies its pieces into one reusable byte
buffer (``uint8``, ``chunk_bytes`` long, on the group's device), ``dist.broadcast`` sends it, and each receiver
copies every piece straight from the buffer into its destination tensor. The pieces are byte views of the
buffer reinterpreted with ``Tensor.view(dtype)``, so delivery is bitwise exact for every dtype (bool, bfloat16,
float8, complex, int64: NaN payloads included) and non-contiguous tensors are read and written with strided
``copy_`` (:mod:`swiftrun.runtime.state.blocks`), never through a full contiguous copy.

Peak extra memory on every member: one chunk buffer, plus, on receivers, the destinations the caller did not
provide (which are the receiver's own state from then on). No flat copy of the state exists anywhere.

Which leaves are streamed: strided (dense) tensors with more than one element, on any device. Receivers place
a streamed tensor on their own ``device`` when the source's copy was on the group's device type (``cuda:0`` on
the source becomes ``cuda:<local>`` on a receiver), on the CPU when it was on the CPU (a CPU tensor under NCCL
is staged through the device buffer, not pickled), and on the current device of its type otherwise (a CUDA
tensor under gloo is staged through the CPU buffer). Everything else travels in the skeleton: 0-d and
one-element tensors (Adam's ``step``), empty tensors, sparse, quantized and meta tensors, numpy arrays, and any object that is not a dict, list or tuple (a tensor inside an arbitrary
object is pickled with it). Inline tensors are cloned to the CPU for pickling (a view never drags its whole
storage along) and restored on the receiver's ``device`` when they came from the group's device type.

Containers keep their type, by the rules of :mod:`swiftrun.runtime.state.skeleton` (the one walk the runtime's
skeletons share: dict subclasses such as ``state_dict``'s ``OrderedDict`` with its ``_metadata`` rebuilt from a
shallow copy, namedtuples from their fields). A tensor that appears several times on the
source (tied weights: the same storage, offset, shape and strides) is sent once; a receiver that allocates it
gets one tensor at every path (the tie survives), one that provides destinations gets each written.

Every member of ``group`` takes part and receives (the caller builds a group of source + targets).
``src`` is a global rank, as for ``dist.broadcast``. A destination the caller provides must have the source's
shape and dtype; a mismatch on any receiver is found before the first chunk and raises :class:`TransferError`
on every member together (one small all-reduce decides), so nobody is left waiting in a broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from swiftrun.runtime.state import skeleton as skeleton_of
from swiftrun.runtime.state.blocks import element_blocks

DEFAULT_CHUNK_BYTES = 64 << 20  # on a GPU: large messages amortise NCCL's per-collective latency
DEFAULT_CPU_CHUNK_BYTES = 16 << 20  # gloo on the CPU: as fast as 64 MiB or faster, measured, at a quarter the memory
MIN_CHUNK_BYTES = 16  # the largest element (complex128) must fit in a chunk
FORMAT = 1

Path = skeleton_of.Path
Destination = Callable[[Path, torch.Size, torch.dtype, torch.device], "torch.Tensor | None"]


class TransferError(RuntimeError):
    """The transfer cannot proceed (bad arguments, a destination that does not fit, a missing device)."""


def path_str(path: Path) -> str:
    """``("optimizers", 0, "state", 3, "exp_avg")`` -> ``"optimizers.0.state.3.exp_avg"``."""
    return ".".join(str(p) for p in path) if path else "<root>"


def default_chunk_bytes(device: torch.device | str) -> int:
    return DEFAULT_CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else DEFAULT_CHUNK_BYTES


def validate_chunk_bytes(chunk_bytes: Any) -> int:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TransferError(f"chunk_bytes must be an int, not {type(chunk_bytes).__name__}")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise TransferError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES} bytes, got {chunk_bytes}")
    return chunk_bytes


# ---------------------------------------------------------------------------------------------------------------
# the plan: pure arithmetic on (numel, itemsize), the same on every rank


class Piece(NamedTuple):
    tensor: int  # index into the spec list
    start: int  # first element (flattened, row-major)
    stop: int  # one past the last element
    offset: int  # byte offset in the chunk buffer (a multiple of the element size)


class Chunk(NamedTuple):
    nbytes: int  # bytes of the buffer this chunk uses (what is broadcast)
    pieces: tuple[Piece, ...]


def plan_chunks(sizes: list[tuple[int, int]], chunk_bytes: int) -> list[Chunk]:
    """Pack tensors of ``sizes`` = [(numel, itemsize), ...] into chunks of at most ``chunk_bytes`` bytes.

    Tensors are laid out in order; each piece starts at an offset aligned to its element size; a tensor that
    does not fit in what is left of the current chunk fills it and continues in the next ones. Tensors with no
    elements take no room.
    """
    validate_chunk_bytes(chunk_bytes)
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    cursor = 0
    for index, (numel, itemsize) in enumerate(sizes):
        if itemsize > chunk_bytes:
            raise TransferError(f"an element of {itemsize} bytes does not fit in a chunk of {chunk_bytes}")
        done = 0
        while done < numel:
            cursor = -(-cursor // itemsize) * itemsize  # align up
            room = (chunk_bytes - cursor) // itemsize if cursor < chunk_bytes else 0
            if room == 0:
                chunks.append(Chunk(_used(pieces, sizes), tuple(pieces)))
                pieces, cursor = [], 0
                room = chunk_bytes // itemsize
            take = min(room, numel - done)
            pieces.append(Piece(index, done, done + take, cursor))
            cursor += take * itemsize
            done += take
    if pieces:
        chunks.append(Chunk(_used(pieces, sizes), tuple(pieces)))
    return chunks


def _used(pieces: list[Piece], sizes: list[tuple[int, int]]) -> int:
    last = pieces[-1]
    return last.offset + (last.stop - last.start) * sizes[last.tensor][1]


# ---------------------------------------------------------------------------------------------------------------
# the skeleton


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str  # where the source's tensor lives: "cpu", or a device type ("cuda")
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)


@dataclass(frozen=True)
class _Slot:
    """Stands for streamed tensor ``index`` in the skeleton."""

    index: int


@dataclass(frozen=True)
class _Inline:
    """A tensor that travels in the skeleton (cloned to the CPU), and the device type it came from."""

    tensor: torch.Tensor
    device_type: str


def _streamable(t: torch.Tensor, device: torch.device) -> bool:
    return (
        t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and t.numel() > 1
    )


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), t.is_conj(), t.is_neg())


class _Splitter:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensors: list[torch.Tensor] = []
        self.specs: list[_Spec] = []
        self._seen: dict[tuple[Any, ...], int] = {}

    def split(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if _streamable(t, self.device):
                key = _alias_key(t)
                index = self._seen.get(key)
                if index is None:
                    index = self._seen[key] = len(self.tensors)
                    self.tensors.append(t)
                    self.specs.append(_Spec(tuple(t.shape), t.dtype, t.device.type, obj.requires_grad))
                return _Slot(index)
            if t.device.type == "meta":
                return _Inline(t, "meta")
            if t.layout == torch.strided and not t.is_quantized:
                cpu = t.to("cpu", copy=True)  # a clone: pickling a view would send its whole storage
            else:
                cpu = t.cpu() if t.device.type != "cpu" else t.clone()
            if obj.requires_grad:
                cpu.requires_grad_(True)
            return _Inline(cpu, t.device.type)
        return obj


# ---------------------------------------------------------------------------------------------------------------
# the transfer


@dataclass
class TransferStats:
    """Filled by :func:`broadcast_tree` when passed as ``stats``."""

    tensors: int = 0  # streamed tensors (after de-duplication)
    stream_bytes: int = 0  # bytes of tensor data streamed
    chunks: int = 0
    chunk_bytes: int = 0
    skeleton_seconds: float = 0.0
    stream_seconds: float = 0.0
    allocated: list[str] = field(default_factory=list)  # paths this receiver allocated (no destination given)


def encode(tree: Any, device: torch.device, chunk_bytes: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Source: the header to broadcast (skeleton, specs, chunk size) and the streamed tensors, in spec order."""
    chunk_bytes = validate_chunk_bytes(chunk_bytes)
    splitter = _Splitter(device)
    skeleton = skeleton_of.map_tree(tree, splitter.split)
    return {"format": FORMAT, "chunk_bytes": chunk_bytes, "specs": splitter.specs, "tree": skeleton}, splitter.tensors


def broadcast_tree(
    tree: Any,
    *,
    src: int,
    group: Any = None,
    device: torch.device | str = "cpu",
    chunk_bytes: int | None = None,
    destination: Destination | None = None,
    on_chunk: Callable[[int], None] | None = None,
    rank: int | None = None,
    stats: TransferStats | None = None,
) -> Any:
    """Broadcast ``tree`` from global rank ``src`` to every member of ``group``; returns the tree on every member.

    ``tree`` is read on ``src`` only (ignored elsewhere; pass None). ``device`` is where this rank's
    collectives want tensors (``cuda:<local>`` for NCCL, ``cpu`` for gloo). ``chunk_bytes`` is read on the
    source and sent to the others (theirs is ignored); None picks :func:`default_chunk_bytes` for the source's
    device (64 MiB on a GPU, 16 MiB on the CPU). ``destination(path, shape, dtype, device)`` is called on
    receivers for every tensor of the tree (streamed or inline) and may return a tensor of that shape and dtype
    (any device, any strides) to be written in place; None allocates a fresh one (``torch.empty`` on ``device``).
    ``on_chunk(index)`` runs on every member after chunk ``index`` was broadcast (and, on receivers, copied).
    On the source the tree itself is returned; on receivers the rebuilt tree, tensors replaced by the
    destinations.
    """
    device = torch.device(device)
    if rank is None:
        rank = dist.get_rank()
    t0 = time.perf_counter()
    sources: list[torch.Tensor] = []
    header: dict[str, Any] | None = None
    if rank == src:
        header, sources = encode(tree, device, default_chunk_bytes(device) if chunk_bytes is None else chunk_bytes)
    box = [header]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type != "cpu" else None)
    header = box[0]
    if header.get("format") != FORMAT:
        raise TransferError(f"the source speaks transfer format {header.get('format')}, this rank {FORMAT}")
    chunk_bytes = header["chunk_bytes"]
    specs: list[_Spec] = header["specs"]
    chunks = plan_chunks([(s.numel, s.itemsize) for s in specs], chunk_bytes)
    t1 = time.perf_counter()

    targets: list[list[torch.Tensor]] = []
    if rank == src:
        result = tree
    else:
        problem, result, targets, allocated, inline_copies = _resolve(header["tree"], specs, device, destination)
        _agree(problem, device, group)
        with torch.no_grad():
            for dest, value in inline_copies:
                dest.detach().copy_(value)
        if stats is not None:
            stats.allocated = allocated
    if rank == src:
        _agree(None, device, group)

    if chunks:
        buffer = torch.empty(max(c.nbytes for c in chunks), dtype=torch.uint8, device=device)
        with torch.no_grad():
            for index, chunk in enumerate(chunks):
                data = buffer[: chunk.nbytes]
                if rank == src:
                    pack(data, chunk, sources, specs)
                dist.broadcast(data, src, group=group)
                if rank != src:
                    unpack(data, chunk, targets, specs)
                if on_chunk is not None:
                    on_chunk(index)
        del buffer
    if stats is not None:
        stats.tensors = len(specs)
        stats.stream_bytes = sum(s.numel * s.itemsize for s in specs)
        stats.chunks = len(chunks)
        stats.chunk_bytes = chunk_bytes
        stats.skeleton_seconds = t1 - t0
        stats.stream_seconds = time.perf_counter() - t1
    return result


def pack(data: torch.Tensor, chunk: Chunk, sources: list[torch.Tensor], specs: list[_Spec]) -> None:
    """Source: copy ``chunk``'s pieces of ``sources`` into the byte buffer ``data``."""
    for piece in chunk.pieces:
        _copy_piece(data, piece, sources[piece.tensor], specs[piece.tensor], outgoing=True)


def unpack(data: torch.Tensor, chunk: Chunk, targets: list[list[torch.Tensor]], specs: list[_Spec]) -> None:
    """Receiver: copy ``chunk``'s pieces from the byte buffer ``data`` into every destination."""
    for piece in chunk.pieces:
        for dest in targets[piece.tensor]:
            _copy_piece(data, piece, dest, specs[piece.tensor], outgoing=False)


def _copy_piece(data: torch.Tensor, piece: Piece, tensor: torch.Tensor, spec: _Spec, outgoing: bool) -> None:
    n = piece.stop - piece.start
    segment = data[piece.offset: piece.offset + n * _itemsize(spec.dtype)].view(spec.dtype)
    k = 0
    for view in element_blocks(tensor.detach(), piece.start, piece.stop):  # detach: Parameters are written too
        m = view.numel()
        part = segment[k: k + m].view(view.shape)
        if outgoing:
            part.copy_(view)
        else:
            view.copy_(part)
        k += m


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _placement(device_type: str, device: torch.device) -> torch.device:
    if device_type == device.type:
        return device
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type)  # e.g. a CUDA tensor under gloo: this rank's current device of that type


def _resolve(skeleton: Any, specs: list[_Spec], device: torch.device, destination: Destination | None,
             ) -> tuple[str | None, Any, list[list[torch.Tensor]], list[str], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Receiver: pick (or allocate) every tensor's destination before any chunk arrives.

    Returns (problem or None, rebuilt tree, destinations per streamed tensor, allocated paths, inline tensors
    to copy into provided destinations)."""
    targets: list[list[torch.Tensor]] = [[] for _ in specs]
    shared: dict[int, torch.Tensor] = {}  # streamed tensor -> the one allocated for it (ties survive)
    allocated: list[str] = []
    problems: list[str] = []
    inline_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def provided(path: Path, shape: torch.Size, dtype: torch.dtype, where: torch.device) -> torch.Tensor | None:
        if destination is None:
            return None
        try:
            dest = destination(path, shape, dtype, where)
        except Exception as exc:  # noqa: BLE001 - reported to every member, not raised alone mid-protocol
            problems.append(f"destination for {path_str(path)} raised {type(exc).__name__}: {exc}")
            return None
        if dest is None:
            return None
        why = _unfit(dest, shape, dtype)
        if why:
            problems.append(f"destination for {path_str(path)}: {why}")
            return None
        return dest

    def rebuild(obj: Any, path: Path) -> Any:
        if isinstance(obj, _Slot):
            spec = specs[obj.index]
            where = _placement(spec.device_type, device)
            shape = torch.Size(spec.shape)
            dest = provided(path, shape, spec.dtype, where)
            if dest is None:
                dest = shared.get(obj.index)
                if dest is None:
                    try:
                        dest = torch.empty(shape, dtype=spec.dtype, device=where)
                    except Exception as exc:  # noqa: BLE001 - e.g. no CUDA here for a CUDA tensor under gloo
                        problems.append(f"cannot allocate {path_str(path)} on {where}: {exc}")
                        return None
                    if spec.requires_grad:
                        dest.requires_grad_(True)
                    shared[obj.index] = dest
                    targets[obj.index].append(dest)
                    allocated.append(path_str(path))
            elif all(d is not dest for d in targets[obj.index]):
                targets[obj.index].append(dest)
            return dest
        if isinstance(obj, _Inline):
            value = obj.tensor
            where = _placement(obj.device_type, device) if obj.device_type != "meta" else value.device
            dest = provided(path, value.shape, value.dtype, where)
            if dest is not None:
                inline_copies.append((dest, value))  # written once every member agreed to go on
                return dest
            if where != value.device:
                try:
                    value = value.to(where)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"cannot place {path_str(path)} on {where}: {exc}")
            return value
        return obj

    tree = skeleton_of.map_tree_at(skeleton, rebuild)
    return ("; ".join(problems) or None), tree, targets, allocated, inline_copies


def _unfit(dest: Any, shape: torch.Size, dtype: torch.dtype) -> str | None:
    if not isinstance(dest, torch.Tensor):
        return f"expected a tensor, got {type(dest).__name__}"
    if dest.shape != shape:
        return f"shape {tuple(dest.shape)} but the source sends {tuple(shape)}"
    if dest.dtype != dtype:
        return f"dtype {dest.dtype} but the source sends {dtype}"
    if dest.layout != torch.strided or dest.is_quantized or dest.device.type == "meta":
        return f"cannot write into a {dest.layout} {'quantized ' if dest.is_quantized else ''}tensor on {dest.device}"
    if any(st == 0 and sz > 1 for st, sz in zip(dest.stride(), dest.shape)):
        return "it has overlapping elements (an expanded view)"
    return None


def _agree(problem: str | None, device: torch.device, group: Any) -> None:
    """Every member learns whether any receiver rejected its destinations; all raise together if so."""
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    messages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, (dist.get_rank(), problem), group=group)
    detail = "; ".join(f"rank {r}: {p}" for r, p in messages if p)
    raise TransferError(f"state transfer refused before streaming: {detail}")
