"""examples/train_pp.py's stage checkpoints: the resume point when a kill left the ranks' files out of step."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers import EXAMPLES


@pytest.fixture(scope="module")
def train_pp():
    spec = importlib.util.spec_from_file_location("train_pp", EXAMPLES / "train_pp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save(train_pp, ckpt, stage, *steps):
    for step in steps:
        train_pp.save_checkpoint(str(ckpt), stage, 0, {"step": step})


def test_no_checkpoint_resumes_at_zero(train_pp, tmp_path) -> None:
    assert train_pp.resume_step(str(tmp_path), 2, 1) == 0


def test_every_rank_saved_the_same_step(train_pp, tmp_path) -> None:
    save(train_pp, tmp_path, 0, 10, 20)
    save(train_pp, tmp_path, 1, 10, 20)
    assert train_pp.resume_step(str(tmp_path), 2, 1) == 20


def test_a_kill_between_two_ranks_saves_falls_back_to_the_previous_checkpoint(train_pp, tmp_path) -> None:
    save(train_pp, tmp_path, 0, 10, 20)
    save(train_pp, tmp_path, 1, 10)  # killed before its save of step 20
    assert train_pp.resume_step(str(tmp_path), 2, 1) == 10
    assert train_pp.saved_steps(str(tmp_path), 0, 0)[10].endswith("stage0-replica0.prev.pt")


def test_a_kill_during_the_first_round_restarts_from_scratch(train_pp, tmp_path) -> None:
    save(train_pp, tmp_path, 0, 10)
    assert train_pp.resume_step(str(tmp_path), 2, 1) == 0
    assert torch.load(tmp_path / "stage0-replica0.pt", weights_only=True)["step"] == 10
