from __future__ import annotations

import math
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

from swiftrun.runtime.state import digest as D


def state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return {"models": [model.state_dict()], "optimizers": [opt.state_dict()], "schedulers": [sched.state_dict()],
            "scaler": None, "user": {"epoch": 2, "name": "run"}, "extra": {"step": 11}}


def test_paths_and_determinism():
    d = D.digest_tree(state())
    assert "models.0.0.weight" in d
    assert "optimizers.0.state.0.exp_avg" in d and "optimizers.0.state.0.step" in d
    assert "optimizers.0.param_groups.0.lr" in d and "optimizers.0.param_groups.0.params.3" in d
    assert "schedulers.0.last_epoch" in d and "scaler" in d and "extra.step" in d
    assert d == D.digest_tree(state())
    assert all(len(v) == 2 * D.DIGEST_BYTES and int(v, 16) >= 0 for v in d.values())


def test_a_changed_value_changes_only_its_path():
    a, b = state(), state()
    b["optimizers"][0]["param_groups"][0]["lr"] = math.nextafter(0.01, 1)
    da, db = D.digest_tree(a), D.digest_tree(b)
    assert {p for p in da if da[p] != db[p]} == {"optimizers.0.param_groups.0.lr"}
    b = state()
    w = b["models"][0]["1.bias"]
    w.view(torch.int32)[0] ^= 1  # one bit
    db = D.digest_tree(b)
    assert {p for p in da if da[p] != db[p]} == {"models.0.1.bias"}


@pytest.mark.parametrize("x, y", [
    (0.0, -0.0), (1, 1.0), (1, True), (0, False), (None, 0), ("1", 1), (b"a", "a"), ([], ()), ({}, []),
    (float("nan"), struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]),
])
def test_scalars_are_exact_and_typed(x, y):
    assert D.digest_tree({"v": x}) != D.digest_tree({"v": y})


def test_nan_equals_itself():
    assert D.digest_tree({"v": float("nan")}) == D.digest_tree({"v": float("nan")})


def test_empty_containers_are_leaves():
    assert D.digest_tree({}) == {D.ROOT: D.value_digest(("empty", "dict"))}
    assert D.digest_tree({"state": {}}) != D.digest_tree({})
    assert "a.b" in D.digest_tree({"a": {"b": []}})
    assert D.digest_tree(5) == {D.ROOT: D.value_digest(5)}


def test_tensor_dtype_shape_and_layout_independence():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    base = D.tensor_digest(t)
    assert D.tensor_digest(t.clone()) == base
    assert D.tensor_digest(t.t().contiguous().t()) == base  # same values, other strides
    assert D.tensor_digest(t.reshape(4, 3)) != base
    assert D.tensor_digest(t.double()) != base
    assert D.tensor_digest(t.view(torch.int32)) != base  # same bytes, other dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.bool, torch.float16, torch.complex64, torch.int64,
                                   torch.uint8, torch.float8_e5m2])
def test_dtypes_without_numpy_equivalent(dtype):
    t = (torch.arange(24) % 7).to(dtype).reshape(4, 6)
    assert D.tensor_digest(t) == D.tensor_digest(t.clone())
    assert D.tensor_digest(t) == D.tensor_digest(t.t().contiguous().t())
    if dtype != torch.bool:
        u = t.clone()
        u[0, 0] = 1 if dtype != torch.bool else True
        assert D.tensor_digest(u) != D.tensor_digest(t)


def test_non_contiguous_pieces_match_contiguous():
    t = torch.randn(50, 30).t()  # non-contiguous
    assert D.tensor_digest(t, piece_bytes=64) == D.tensor_digest(t.contiguous())
    assert D.tensor_digest(t[::2, 3:], piece_bytes=17) == D.tensor_digest(t[::2, 3:].contiguous())


def test_zero_d_empty_and_conjugate():
    assert D.tensor_digest(torch.tensor(3.0)) == D.tensor_digest(torch.tensor(3.0))
    assert D.tensor_digest(torch.tensor(3.0)) != D.tensor_digest(torch.tensor([3.0]))
    assert D.tensor_digest(torch.empty(0, 3)) != D.tensor_digest(torch.empty(3, 0))
    z = torch.randn(3, dtype=torch.complex64)
    assert D.tensor_digest(z.conj()) == D.tensor_digest(z.conj().resolve_conj())
    assert D.tensor_digest(z.conj()) != D.tensor_digest(z)


def test_numpy_and_objects():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert D.value_digest(a) == D.value_digest(a.copy())
    assert D.value_digest(a) != D.value_digest(a.astype(np.int64))
    assert D.value_digest(np.random.RandomState(1).get_state()) == D.value_digest(np.random.RandomState(1).get_state())
    d = OrderedDict(a=1)
    assert D.digest_tree({"x": d}) == D.digest_tree({"x": {"a": 1}})


def test_mismatches_majority_and_missing():
    per_rank = {0: {"a": "x", "b": "y"}, 1: {"a": "x", "b": "y"}, 2: {"a": "z", "b": "y"}, 3: {"a": "x"}}
    found = D.mismatches(per_rank)
    assert [m.path for m in found] == ["a", "b"]
    a, b = found
    assert a.majority == "x" and a.majority_ranks == (0, 1, 3) and a.odd_ranks == (2,)
    assert b.majority == "y" and b.others == ((D.MISSING, (3,)),)
    assert str(a).startswith("a differs on rank 2 (z on rank 2; x on ranks 0,1,3)")
    assert "b differs on rank 3" in D.describe(found)


def test_mismatch_tie_goes_to_lowest_rank():
    found = D.mismatches({0: {"a": "p"}, 1: {"a": "q"}})
    assert found[0].majority == "p" and found[0].odd_ranks == (1,)


def test_combined_per_top_level_entry():
    d = D.digest_tree(state())
    c = D.combined(d)
    assert set(c) == {"models", "optimizers", "schedulers", "scaler", "user", "extra"}
    other = state()
    other["user"]["epoch"] = 3
    c2 = D.combined(D.digest_tree(other))
    assert {k for k in c if c[k] != c2[k]} == {"user"}


def test_fast_on_cpu():
    import time

    t = torch.randn(4_000_000)  # 16 MB
    start = time.perf_counter()
    D.tensor_digest(t)
    assert time.perf_counter() - start < 2.0
