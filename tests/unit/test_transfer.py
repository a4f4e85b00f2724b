"""Pure tests of the chunked transfer: the plan, the byte packing, destinations, the skeleton.

``loopback`` runs the source's and a receiver's halves of :func:`broadcast_tree` in one process, with the
header pickled in between and the chunk buffer shared instead of broadcast (the multi-process test in
tests/integration/test_transfer_gloo.py covers the real collectives).
"""

from __future__ import annotations

import pickle
from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swiftrun.runtime.state import transfer as T
from swiftrun.runtime.state.blocks import element_blocks

CPU = torch.device("cpu")


def loopback(tree, chunk_bytes, destination=None, poison=True):
    header, sources = T.encode(tree, CPU, chunk_bytes)
    header = pickle.loads(pickle.dumps(header))
    specs = header["specs"]
    chunks = T.plan_chunks([(s.numel, s.itemsize) for s in specs], header["chunk_bytes"])
    problem, result, targets, allocated, inline = T._resolve(header["tree"], specs, CPU, destination)
    if problem:
        raise T.TransferError(problem)
    for dest, value in inline:
        dest.detach().copy_(value)
    buffer = torch.empty(max([c.nbytes for c in chunks], default=0), dtype=torch.uint8)
    for chunk in chunks:
        assert chunk.nbytes <= chunk_bytes
        data = buffer[: chunk.nbytes]
        if poison:
            data.fill_(0xA5)  # a receiver must never read bytes the source did not write for this chunk
        T.pack(data, chunk, sources, specs)
        T.unpack(data, chunk, targets, specs)
    return result, chunks, allocated


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.numel() == 0:
        return True
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_tree_equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert same_bits(a, b)
        assert a.requires_grad == b.requires_grad
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_tree_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_tree_equal(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def random_bits(shape, dtype, seed=0):
    """Arbitrary bit patterns (NaNs with payloads, denormals, -0.0) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


# --- the plan --------------------------------------------------------------------------------------------------


def covered(chunks, sizes):
    seen = {i: [] for i in range(len(sizes))}
    for chunk in chunks:
        end = 0
        for p in sorted(chunk.pieces, key=lambda p: p.offset):
            itemsize = sizes[p.tensor][1]
            assert p.offset % itemsize == 0
            assert p.offset >= end
            end = p.offset + (p.stop - p.start) * itemsize
            seen[p.tensor].append((p.start, p.stop))
        assert end == chunk.nbytes
    for i, (numel, _) in enumerate(sizes):
        ranges = sorted(seen[i])
        pos = 0
        for a, b in ranges:
            assert a == pos and b > a
            pos = b
        assert pos == numel


def test_plan_empty():
    assert T.plan_chunks([], 64) == []
    assert T.plan_chunks([(0, 4), (0, 8)], 64) == []


def test_plan_exactly_one_chunk():
    chunks = T.plan_chunks([(16, 4), (3, 4)], 64)
    assert [c.nbytes for c in chunks] == [64, 12]
    assert chunks[0].pieces == (T.Piece(0, 0, 16, 0),)
    assert chunks[1].pieces == (T.Piece(1, 0, 3, 0),)


def test_plan_split_large_tensor():
    chunks = T.plan_chunks([(100, 8)], 256)
    assert [c.nbytes for c in chunks] == [256, 256, 256, 32]
    assert [c.pieces[0].start for c in chunks] == [0, 32, 64, 96]
    covered(chunks, [(100, 8)])


def test_plan_packs_small_tensors_with_alignment():
    sizes = [(3, 1), (2, 8), (1, 2), (5, 4)]
    chunks = T.plan_chunks(sizes, 1024)
    assert len(chunks) == 1
    offsets = [p.offset for p in chunks[0].pieces]
    assert offsets == [0, 8, 24, 28]
    assert chunks[0].nbytes == 48


def test_plan_chunk_not_multiple_of_itemsize():
    sizes = [(10, 8), (7, 16)]
    chunks = T.plan_chunks(sizes, 20)  # 2 doubles per chunk, one complex128 per chunk
    covered(chunks, sizes)
    assert all(c.nbytes <= 20 for c in chunks)
    assert len(chunks) == 5 + 7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.sampled_from([1, 2, 4, 8, 16])), max_size=12),
       st.integers(16, 600))
def test_plan_covers_everything(sizes, chunk_bytes):
    chunks = T.plan_chunks(sizes, chunk_bytes)
    covered(chunks, sizes)
    assert all(0 < c.nbytes <= chunk_bytes for c in chunks)
    # no chunk but the last could have taken the next piece's first element
    for a, b in zip(chunks, chunks[1:]):
        first = b.pieces[0]
        itemsize = sizes[first.tensor][1]
        assert -(-a.nbytes // itemsize) * itemsize + itemsize > chunk_bytes


@pytest.mark.parametrize("bad", [0, 15, -1, 2.5, "64", True, None])
def test_chunk_bytes_validation(bad):
    with pytest.raises(T.TransferError):
        T.validate_chunk_bytes(bad)
    with pytest.raises(T.TransferError):
        T.encode({"w": torch.zeros(4)}, CPU, bad)


def test_default_chunk_size():
    assert T.validate_chunk_bytes(T.DEFAULT_CHUNK_BYTES) == 64 << 20
    assert T.default_chunk_bytes("cpu") == 16 << 20 and T.default_chunk_bytes(torch.device("cuda", 1)) == 64 << 20


# --- blocks ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: torch.arange(60.).reshape(3, 4, 5).permute(2, 0, 1),
    lambda: torch.arange(120.).reshape(4, 5, 6)[:, 1:4, ::2],
    lambda: torch.arange(48.).reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last),
    lambda: torch.arange(10.)[::3],
    lambda: torch.arange(24.).reshape(4, 6).t(),
])
def test_element_blocks_cover_ranges_without_copy(make):
    t = make()
    flat = t.reshape(-1).clone()
    n = t.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            views = list(element_blocks(t, a, b))
            for v in views:
                assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            got = torch.cat([v.reshape(-1) for v in views]) if views else torch.empty(0)
            assert torch.equal(got, flat[a:b])


# --- loopback delivery -----------------------------------------------------------------------------------------


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.bool, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.complex64, torch.complex128, torch.float8_e4m3fn]


@pytest.mark.parametrize("chunk_bytes", [16, 20, 64, 100, 4096, T.DEFAULT_CHUNK_BYTES])
def test_mixed_dtypes_bitwise(chunk_bytes):
    tree = {f"t{i}": random_bits((3, 5), dt, seed=i) for i, dt in enumerate(DTYPES)}
    tree["nan"] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    result, chunks, _ = loopback(tree, chunk_bytes)
    assert_tree_equal(tree, result)
    assert len(chunks) >= 1


def test_empty_tree_and_scalars_only():
    for tree in ({}, [], None, {"a": 1, "b": [2.5, "x", None, True], "c": ()}):
        result, chunks, _ = loopback(tree, 64)
        assert chunks == []
        assert_tree_equal(tree, result)


def test_tensor_exactly_chunk_sized_then_larger():
    tree = {"exact": random_bits((16,), torch.float32), "bigger": random_bits((17,), torch.float32, 1)}
    result, chunks, _ = loopback(tree, 64)
    assert [c.nbytes for c in chunks] == [64, 64, 4]
    assert_tree_equal(tree, result)


def test_many_tiny_tensors_share_chunks():
    tree = [random_bits((2,), torch.float64, i) for i in range(1000)]
    result, chunks, _ = loopback(tree, 1024)
    assert len(chunks) == 1000 * 16 // 1024 + 1
    assert_tree_equal(tree, result)


def test_non_contiguous_sources_and_destinations():
    base = random_bits((6, 7, 8), torch.float32)
    tree = {"perm": base.permute(2, 0, 1), "slice": base[:, 1:5, ::3],
            "cl": random_bits((2, 3, 4, 5), torch.bfloat16).contiguous(memory_format=torch.channels_last),
            "t": random_bits((9, 4), torch.complex64).t()}
    dests = {k: torch.empty(v.shape[::-1], dtype=v.dtype).transpose(0, -1) if v.dim() > 1 else torch.empty_like(v)
             for k, v in tree.items()}
    for k in dests:
        dests[k] = dests[k].reshape(tree[k].shape) if dests[k].shape != tree[k].shape else dests[k]
    ptrs = {k: d.data_ptr() for k, d in dests.items()}
    result, _, allocated = loopback(tree, 40, destination=lambda path, shape, dtype, dev: dests.get(path[0]))
    assert allocated == []
    for k in tree:
        assert result[k] is dests[k] and result[k].data_ptr() == ptrs[k]
        assert same_bits(result[k], tree[k])


def test_conjugate_view_source():
    z = random_bits((4, 3), torch.complex64)
    result, _, _ = loopback({"z": z.conj()}, 32)
    assert same_bits(result["z"], z.conj().resolve_conj())


def test_zero_d_and_one_element_inline():
    step = torch.tensor(7.0)
    tree = {"step": step, "one": torch.tensor([3], dtype=torch.int64), "empty": torch.empty(0, 3),
            "w": torch.randn(4)}
    header, sources = T.encode(tree, CPU, 64)
    assert len(sources) == 1 and sources[0] is not None
    assert isinstance(header["tree"]["step"], T._Inline)
    assert isinstance(header["tree"]["w"], T._Slot)
    result, _, _ = loopback(tree, 64)
    assert_tree_equal(tree, result)
    # a provided destination of an inline tensor is written in place too
    own = torch.tensor(0.0)
    result, _, _ = loopback(tree, 64, destination=lambda p, s, d, dev: own if p == ("step",) else None)
    assert result["step"] is own and own.item() == 7.0


def test_inline_view_does_not_send_its_storage():
    big = torch.randn(100_000)
    header, _ = T.encode({"s": big[5]}, CPU, 64)
    assert len(pickle.dumps(header)) < 10_000


def test_destination_provided_vs_allocated():
    tree = {"models": [{"w": torch.randn(5, 5), "b": torch.randn(5)}],
            "optimizers": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 5)}},
                            "param_groups": [{"lr": 0.1, "params": [0]}]}]}
    own_w = torch.zeros(5, 5)
    calls = []

    def destination(path, shape, dtype, device):
        calls.append(path)
        return own_w if path == ("models", 0, "w") else None

    result, _, allocated = loopback(tree, 32, destination)
    assert result["models"][0]["w"] is own_w
    assert_tree_equal(tree, result)
    assert ("optimizers", 0, "state", 0, "exp_avg") in calls and ("optimizers", 0, "state", 0, "step") in calls
    assert sorted(allocated) == ["models.0.b", "optimizers.0.state.0.exp_avg"]


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(4, 4), "shape (4, 4) but the source sends (5, 5)"),
    (torch.zeros(5, 5, dtype=torch.float64), "dtype torch.float64 but the source sends torch.float32"),
    ([0.0] * 25, "expected a tensor"),
    (torch.zeros(5).expand(5, 5), "overlapping"),
])
def test_destination_mismatch_is_a_clear_error(bad, message):
    tree = {"models": [{"w": torch.randn(5, 5)}]}
    with pytest.raises(T.TransferError, match="models.0.w") as info:
        loopback(tree, 64, destination=lambda *a: bad)
    assert message in str(info.value)


def test_destination_that_raises_is_reported():
    def destination(path, *_):
        raise KeyError("no such parameter")

    with pytest.raises(T.TransferError, match="raised KeyError"):
        loopback({"w": torch.randn(3)}, 64, destination)


Pair = namedtuple("Pair", "a b")


def test_containers_keep_their_types():
    sd = OrderedDict(w=torch.randn(3, 2), b=torch.randn(2))
    sd._metadata = OrderedDict({"": {"version": 2}})
    tree = {"sd": sd, "pair": Pair(torch.randn(4), 2), "tup": (1, torch.randn(2, 2)), "d": {3: "x", (1, 2): 4.5}}
    result, _, _ = loopback(tree, 16)
    assert_tree_equal(tree, result)
    assert result["sd"]._metadata == sd._metadata
    assert result["pair"].a.shape == (4,)


def test_tied_tensors_sent_once_and_stay_tied():
    w = torch.randn(8, 4)
    tree = {"enc": w, "dec": w.detach(), "other": w.clone()}
    header, sources = T.encode(tree, CPU, 64)
    assert len(sources) == 2
    result, _, allocated = loopback(tree, 64)
    assert result["enc"] is result["dec"] and result["other"] is not result["enc"]
    z = torch.randn(3, 2, dtype=torch.complex64)
    header, sources = T.encode({"z": z, "zc": z.conj(), "zn": z.conj().imag}, CPU, 64)
    assert len(sources) == 3  # same data_ptr, other values: never merged
    assert_tree_equal(tree, result)
    own_e, own_d = torch.zeros(8, 4), torch.zeros(8, 4)
    mine = {"enc": own_e, "dec": own_d}
    result, _, _ = loopback(tree, 64, destination=lambda p, *a: mine.get(p[0]))
    assert result["enc"] is own_e and result["dec"] is own_d and torch.equal(own_e, w) and torch.equal(own_d, w)


def test_requires_grad_and_parameters():
    p = torch.nn.Parameter(torch.randn(3, 3))
    own = torch.nn.Parameter(torch.zeros(3, 3))
    result, _, _ = loopback({"p": p, "q": p * 2}, 64, destination=lambda path, *a: own if path == ("p",) else None)
    assert result["p"] is own and torch.equal(own.detach(), p.detach())
    # an allocated tensor mirrors the source's requires_grad, as a leaf
    assert result["q"].requires_grad and result["q"].is_leaf and torch.equal(result["q"].detach(), (p * 2).detach())


def test_arbitrary_objects_inline():
    class Box:
        def __init__(self, v):
            self.v = v

        def __eq__(self, other):
            return isinstance(other, Box) and torch.equal(self.v, other.v)

    import numpy as np

    tree = {"rng": torch.get_rng_state(), "np": np.arange(6).reshape(2, 3), "box": [1, 2]}
    result, _, _ = loopback(tree, 64)
    assert torch.equal(result["rng"], tree["rng"]) and (result["np"] == tree["np"]).all()


def test_stats_and_header_are_small():
    tree = {"w": [torch.randn(1000) for _ in range(50)], "lr": 0.1}
    header, _ = T.encode(tree, CPU, 4096)
    assert len(pickle.dumps(header)) < 20_000
    specs = header["specs"]
    assert sum(s.numel * s.itemsize for s in specs) == 50 * 4000


# --- a receiver's own tensors as destinations ------------------------------------------------------------------


def _trained(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}])
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("survivor", [True, False])
def test_install_into_own_model_and_optimizer(survivor):
    from swiftrun.runtime.state.destinations import destination_from, own_tensors

    src_model, src_opt = _trained(0)
    tree = {"models": [src_model.state_dict()], "optimizers": [src_opt.state_dict()]}
    if survivor:
        model, opt = _trained(1)
    else:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
        opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}])
    own = own_tensors([model], [opt])
    assert len(own) == len(model.state_dict()) + (3 * 4 if survivor else 0)
    ptrs = {path: t.data_ptr() for path, t in own.items()}
    result, _, allocated = loopback(tree, 48, destination_from(own))
    opt.load_state_dict(result["optimizers"][0])
    for (a, b) in zip(model.state_dict().values(), src_model.state_dict().values()):
        assert same_bits(a, b)
    from swiftrun.runtime.state.destinations import optimizer_params

    for p, q in zip(optimizer_params(opt), optimizer_params(src_opt)):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert same_bits(opt.state[p][key], src_opt.state[q][key])
    assert opt.param_groups[1]["lr"] == 0.5
    if survivor:
        assert allocated == []
        for index, p in enumerate(optimizer_params(opt)):
            for key in ("exp_avg", "exp_avg_sq"):
                assert opt.state[p][key].data_ptr() == ptrs[("optimizers", 0, "state", index, key)]
    assert all(model.state_dict()[path[2]].data_ptr() == ptr for path, ptr in ptrs.items() if path[0] == "models")
