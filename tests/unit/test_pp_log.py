"""The pipeline's sender-side log: bounded in memory, the oldest entries spilled to disk and read back."""

from __future__ import annotations

import torch

from swiftrun.runtime.pp.log import LogStore


def entry(step: int, value: float) -> tuple[tuple, torch.Tensor]:
    return (step, "act", 0, 1, 0, 0), torch.full((256,), value)  # 1 KiB each


def test_entries_beyond_the_memory_limit_spill_oldest_first_and_read_back_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTRUN_LOG_SPILL_DIR", str(tmp_path))
    log = LogStore(memory_limit=2048)
    for step in range(5):
        log.put(*entry(step, step + 0.5))
    assert log.memory_bytes <= 2048 and log.total_bytes == 5 * 1024
    spilled = list(tmp_path.glob("swiftrun-log-*/*.pt"))
    assert len(spilled) == 3  # steps 0..2 went to disk, 3 and 4 stay in memory
    for step in range(5):
        key, value = entry(step, step + 0.5)
        assert torch.equal(log.get(key), value)
    got = log.select(lambda k: 1 <= k[0] <= 3)
    assert sorted(k[0] for k in got) == [1, 2, 3]


def test_dropping_entries_removes_their_files_and_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTRUN_LOG_SPILL_DIR", str(tmp_path))
    log = LogStore(memory_limit=1024)
    for step in range(4):
        log.put(*entry(step, float(step)))
    log.drop(lambda k: k[0] < 3)
    assert len(log) == 1 and log.total_bytes == 1024 and log.disk_bytes == 0
    assert not list(tmp_path.glob("swiftrun-log-*/*.pt"))
    log.put(*entry(3, 9.0))  # a redo overwrites the same key
    assert len(log) == 1 and torch.equal(log.get(entry(3, 0.0)[0]), torch.full((256,), 9.0))
    log.clear()
    assert len(log) == 0 and log.total_bytes == 0


def test_put_returns_the_size_and_replacing_a_key_keeps_the_count_right():
    log = LogStore(memory_limit=1 << 20)
    key, value = entry(0, 1.0)
    assert log.put(key, value) == 1024
    assert log.put(key, torch.zeros(128)) == 512  # a redone step's send replaces the old one
    assert len(log) == 1 and log.memory_bytes == 512 and torch.equal(log.get(key), torch.zeros(128))
