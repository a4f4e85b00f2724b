"""Pure parts of the Lightning integration (runtime/frameworks/lightning.py), on Lightning's own objects: the
replacement's counters at the next epoch's start, the fetcher stand-in that replays a window, the version check,
and Lightning's on-the-fly optimizer class unwrapped to the optimizer inside."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.loops.progress import _BatchProgress, _Progress  # noqa: E402

from swiftrun.runtime.frameworks.lightning import (UnsupportedTrainer, _Fetcher, _next_epoch,  # noqa: E402
                                                   check_version)
from swiftrun.runtime.state.registry import unwrap_framework  # noqa: E402

EPOCH = "fit_loop.epoch_progress"
BATCH = "fit_loop.epoch_loop.batch_progress"


def test_lightnings_optimizer_class_made_on_the_fly_is_unwrapped_to_the_optimizer():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    wrapped = LightningOptimizer(optimizer)
    assert type(wrapped).__name__ == "LightningAdamW"  # a class of its own, not LightningOptimizer itself
    assert unwrap_framework(wrapped) is optimizer


def test_counters_at_an_epochs_end_become_the_next_epochs_first_window():
    epoch, batch = _Progress(), _BatchProgress()
    epoch.increment_ready(), epoch.increment_started()  # epoch 0 running
    for _ in range(5):
        for step in (batch.increment_ready, batch.increment_started, batch.increment_processed,
                     batch.increment_completed):
            step()
    batch.is_last_batch = True
    counters = {EPOCH: epoch.state_dict(), BATCH: batch.state_dict(), "fit_loop.epoch_loop._batches_that_stepped": 3}
    out = _next_epoch(counters)
    assert out[EPOCH]["current"] == {"ready": 2, "started": 2, "processed": 1, "completed": 1}
    assert out[BATCH]["current"] == {"ready": 0, "started": 0, "processed": 0, "completed": 0}
    assert out[BATCH]["total"]["completed"] == 5 and out[BATCH]["is_last_batch"] is False
    assert out["fit_loop.epoch_loop._batches_that_stepped"] == 3
    assert counters[BATCH]["current"]["completed"] == 5  # the input is left as it was


class _Driver:
    def __init__(self, replay):
        self.replay, self.window, self.draws = list(replay), [], 0

    def watch_fetch(self):
        return True

    def saw_fetch_draw(self):
        self.draws += 1


class _LightningFetcher:
    def __init__(self, batches):
        self.batches, self.done, self.fetched = list(batches), False, 0

    def __next__(self):
        self.fetched += 1
        self.done = len(self.batches) == 1
        return self.batches.pop(0)


def test_a_redone_window_gets_its_batches_from_memory_then_the_fetchers_own():
    driver = _Driver([("b0", False), ("b1", False)])
    live = _LightningFetcher(["b2", "b3"])
    fetcher = _Fetcher(live, driver)
    got = [(next(fetcher), fetcher.done) for _ in range(4)]
    assert got == [("b0", False), ("b1", False), ("b2", False), ("b3", True)]
    assert driver.window == got  # kept until the step completes, for a second redo
    assert fetcher.fetched == 2  # the fetcher's own attributes show through
    assert driver.draws == 0


def test_a_fetch_that_draws_from_the_global_rng_is_noticed():
    class Drawing(_LightningFetcher):
        def __next__(self):
            torch.rand(1)
            return super().__next__()

    driver = _Driver([])
    next(_Fetcher(Drawing(["b0"]), driver))
    assert driver.draws == 1


@pytest.mark.parametrize("version", ["2.1.4", "1.9.5", "nightly"])
def test_a_lightning_whose_loops_are_not_known_is_refused_with_the_way_out(version):
    with pytest.raises(UnsupportedTrainer, match="DDPStrategy under swiftrun"):
        check_version(version)


def test_the_tested_lightning_is_accepted():
    check_version("2.6.6")
    check_version("2.2.0")


def test_the_strategy_is_named_swift_ddp_and_is_a_ddp_strategy_with_its_arguments():
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import swiftrun.lightning

    trainer = L.Trainer(strategy="swift_ddp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    assert isinstance(trainer.strategy, swiftrun.lightning.SwiftDDPStrategy)
    assert isinstance(trainer.strategy, DDPStrategy)  # what Lightning's compile and DDP checks ask
    strategy = swiftrun.lightning.SwiftDDPStrategy(process_group_backend="gloo", find_unused_parameters=True)
    assert strategy.process_group_backend == "gloo" and strategy._ddp_kwargs == {"find_unused_parameters": True}
