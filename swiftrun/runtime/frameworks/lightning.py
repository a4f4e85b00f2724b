"""In-place recovery for PyTorch Lightning: ``Trainer(strategy=swiftrun.lightning.SwiftDDPStrategy(...))``.

Lightning owns the loop, so the step protocol (``runtime/core/recovery.py``) is driven from the strategy, which
Lightning hands the trainer at ``setup`` (lightning 2.6, ``loops/training_epoch_loop.py``):

- ``setup``: after ``DDPStrategy.setup`` the DDP model, the optimizers, the schedulers and the precision plugin's
  scaler exist, so ``swiftrun.Run`` is made here (a replacement recovers inside it);
- the epoch loop's ``advance`` (one batch: Lightning's SIGTERM broadcast, the fetch, the hooks, the forward and
  backward, on the window's last batch the optimizer and the step-interval schedulers) and ``on_advance_end`` (the
  validation Lightning runs after that batch, the plateau schedulers, ``_batches_that_stepped``) are wrapped on the
  instance. One swiftrun step is one optimizer step: every batch of its ``accumulate_grad_batches`` window, from
  its first ``advance`` to its last ``on_advance_end``, is the guarded body;
- a peer's failure inside a window is repaired where it is caught, the window's loop counters are put back with
  the rest of the step's state, and the window is redone from its first batch with the batches this rank had
  fetched for it (a replay through a stand-in for Lightning's data fetcher: fetching again would give the next
  ones). Lightning's SIGTERM broadcast swallows any exception, which is why the whole window is guarded and an
  aborted generation is also checked once the window ends;
- between windows (an epoch's end, its ModelCheckpoint save, the next epoch's start) a failed collective is
  repaired where it failed and the rest of that stretch's collectives are skipped (``comm/collectives.py``);
  every rank then begins the next window from the state it reached.

A replacement starts ``fit`` like any rank and is positioned at the window to run next: the fit loop at that
epoch before Lightning starts it, the training sampler (a :class:`~swiftrun.ResumableDistributedSampler` swapped
in for the ``DistributedSampler`` Lightning injects, same indices) seeked past the batches already trained, and at
its first window every loop counter as its replica had it there. Nothing is read from a checkpoint.

What travels besides the model, optimizers, schedulers and scaler (:class:`_Progress`): the loops' progress
counters, every callback's ``state_dict`` and ``on_save_checkpoint`` extras, and the LightningModule's
``on_save_checkpoint`` extras, as a Lightning checkpoint would carry them. What does not: ``self.log`` values
accumulated for an epoch and torchmetrics states (a redone window logs its batches again), and files a cut
ModelCheckpoint save left half written (docs/guide/frameworks.md).
"""

from __future__ import annotations

import copy
import enum
import time
from typing import Any, Callable

import torch

from swiftrun.errors import RecoveryError
from swiftrun.runtime.api import Run
from swiftrun.runtime.core.txn import rng_state, set_rng_state
from swiftrun.runtime.sampler import ResumableDistributedSampler
from swiftrun.runtime.worker import process
from swiftrun.runtime.worker.process import warn

TESTED = "2.6.6"
# the counters' names (attribute paths from the trainer's fit loop)
_EPOCH = "fit_loop.epoch_progress"
_BATCH = "fit_loop.epoch_loop.batch_progress"
_STEPPED = "fit_loop.epoch_loop._batches_that_stepped"
# the way out a refusal offers
_OTHERWISE = ("or use Lightning's own DDPStrategy under swiftrun: a failure then restarts every worker "
              "(--max-restarts)")


class Settle(enum.Enum):
    """Where a replacement takes the counters and streams it received from its replica."""

    FIRST_WINDOW = "first window"  # the usual case: as its first window begins
    # its replica was between an epoch's last window and the next epoch: the streams go in before that epoch's
    # iterator draws its seed, the counters at the first window
    STREAMS_AT_EPOCH_START = "streams at epoch start"
    # training ended with the replica's last window: counters and streams at the start of that epoch, whose end
    # this rank then runs
    EPOCH_START = "epoch start"


class UnsupportedTrainer(TypeError):
    """The Trainer is set up in a way this integration cannot recover exactly (said when fit() sets it up)."""


def check_version(version: str) -> None:
    parts = version.split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()) or (int(parts[0]), int(parts[1])) < (2, 2):
        raise UnsupportedTrainer(f"swiftrun.lightning drives the loops of lightning >= 2.2 ({TESTED} tested); "
                                 f"lightning {version} has others. Upgrade lightning, {_OTHERWISE}")


class Driver:
    """Drives one rank's step protocol from the strategy's hooks (see the module docstring)."""

    def __init__(self, strategy: Any, trainer: Any) -> None:
        self.strategy = strategy
        self.trainer = trainer
        self.run: Run | None = None
        self.generation = -1
        self.progress = _Progress(self)
        self.open = False  # a window is begun and not completed
        self.step = -1
        self.window: list[tuple[Any, bool]] = []  # (what the fetcher returned, its ``done`` after) this window
        self.replay: list[tuple[Any, bool]] = []  # handed out before fetching again (a redone window)
        self.recovered_in_window = False  # the batch being advanced was interrupted: its on_advance_end is skipped
        self.fetcher: _Fetcher | None = None
        self.joining_rng: dict[str, Any] | None = None  # a replacement's streams, set again when its first step begins
        self.sampler: ResumableDistributedSampler | None = None
        self.position: tuple[int, int] | None = None  # (epoch, batches into it) a replacement starts at
        self.settle_at = Settle.FIRST_WINDOW
        self.fetch_draws = False
        self.modes: list[bool] | None = None  # every module's train/eval mode as the window began
        self.began = 0.0

    @property
    def rec(self) -> Any:
        return self.run._recovery if self.run is not None else None  # noqa: SLF001 - the runtime's own API

    @property
    def loop(self) -> Any:
        return self.trainer.fit_loop.epoch_loop

    # ------------------------------------------------------------------ set-up

    def start(self) -> None:
        trainer, strategy = self.trainer, self.strategy
        _refuse_unsupported(trainer)
        rt = process.current()
        joining = bool(rt is not None and rt.wenv.joining)
        first_generation = rt.wenv.generation if rt is not None else 0
        scaler = getattr(strategy.precision_plugin, "scaler", None)
        self.run = Run(model=strategy.model, optimizer=list(strategy.optimizers),
                       scheduler=[config.scheduler for config in strategy.lr_scheduler_configs], scaler=scaler,
                       state=self.progress)
        rec = self.rec
        if rec is None:
            return
        self.generation = rec.generation
        if _validates(trainer):
            # a window's step ends with the validation Lightning runs after it, whose collectives follow the update
            # and which zeroes the gradients first: a failure there is undone from a copy, never by inverting
            rec.copies.expect_undo("Lightning validates after a window's update, inside the step")
        loop, fit_loop = self.loop, trainer.fit_loop
        for name in ("advance", "on_advance_end"):
            setattr(loop, name, getattr(self, f"_{name}")(getattr(loop, name)))
        fit_loop.run = self._fit_run(fit_loop.run)
        self.progress.fresh = joining or rec.generation != first_generation
        if joining or rec.generation != first_generation:
            self.joining_rng = rng_state()
            self._position_replacement()

    def training_loader(self, dataloader: Any) -> Any:
        """The training DataLoader with a sampler a replacement can seek (the same indices as Lightning's)."""
        from lightning.pytorch.trainer.states import RunningStage
        from lightning.pytorch.utilities.data import _update_dataloader
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        if self.rec is None or not isinstance(dataloader, DataLoader):
            return dataloader
        sampler = dataloader.sampler
        if type(sampler) is DistributedSampler:  # noqa: E721 - a subclass may order its indices otherwise
            resumable = ResumableDistributedSampler(sampler.dataset, num_replicas=sampler.num_replicas,
                                                    rank=sampler.rank, shuffle=sampler.shuffle, seed=sampler.seed,
                                                    drop_last=sampler.drop_last)
            resumable.set_epoch(sampler.epoch)
            dataloader = _update_dataloader(dataloader, resumable, mode=RunningStage.TRAINING)
            sampler = resumable
        if not isinstance(sampler, ResumableDistributedSampler):
            raise UnsupportedTrainer(
                f"swiftrun.lightning positions a replacement through the training sampler, and "
                f"{type(sampler).__name__} cannot be positioned: let Lightning inject its DistributedSampler "
                f"(use_distributed_sampler=True, the default) or pass a swiftrun.ResumableDistributedSampler, "
                f"{_OTHERWISE}")
        if dataloader.num_workers > 0 and self.rec.rank == 0:
            warn("DataLoader workers are seeded when an epoch's iterator is made, and a replacement makes its own "
                 "mid-epoch: random augmentations in the workers then differ from a failure-free run there (a "
                 "deterministic dataset is unaffected)")
        self.sampler = sampler
        if self.position is not None:
            epoch, batches = self.position
            sampler.seek(epoch * len(sampler) + batches * int(dataloader.batch_size or 1))
        return dataloader

    def _position_replacement(self) -> None:
        """Put the fit loop at the epoch of the window to run next, before Lightning starts that epoch."""
        progress = self.progress.pending
        if progress is None:
            raise RecoveryError("the replacement received no Lightning progress from its replica (swiftrun.lightning)")
        counters = progress["counters"]
        epoch_sd = counters[_EPOCH]
        epoch = epoch_sd["current"]["processed"]
        batches = counters[_BATCH]["current"]["ready"]
        self.settle_at = Settle.FIRST_WINDOW
        if progress["ended"] and self._no_window_after(counters):
            # training ended with the replica's last window: this rank runs what Lightning runs after it, that
            # epoch's end (rank 0 saves the last checkpoint there), with the received counters and streams, and
            # with the collectives skipped (the others ran them)
            self.settle_at = Settle.EPOCH_START
        elif _ended_epoch(progress):
            # the replica was between an epoch's last window and the next epoch: the streams it sent are its live
            # ones, before the next epoch's iterator drew its seed from them, so they are set before this rank's
            # iterator of that epoch is made (its own set-up drew from them too)
            epoch, batches = epoch + 1, 0
            self.settle_at = Settle.STREAMS_AT_EPOCH_START
        if self.settle_at is not Settle.FIRST_WINDOW:
            self.loop.on_run_start = self._settle_at_epoch_start(self.loop.on_run_start)
        self.position = (epoch, batches)
        fit_progress = self.trainer.fit_loop.epoch_progress
        fit_progress.load_state_dict(copy.deepcopy(epoch_sd))
        for tracker in (fit_progress.current, fit_progress.total):
            # Lightning's epoch start raises ready and started: as it is before epoch ``epoch`` began
            tracker.ready = tracker.started = tracker.processed = tracker.completed = (
                tracker.completed + (epoch - epoch_sd["current"]["processed"]))

    def _no_window_after(self, counters: dict[str, Any]) -> bool:
        """Whether training ends after the window these counters ended (max_steps or max_epochs reached)."""
        trainer = self.trainer
        max_steps, max_epochs = trainer.max_steps, trainer.max_epochs
        if max_steps not in (None, -1) and counters[_STEPPED] >= max_steps:
            return True
        last_of_epoch = counters[_BATCH]["is_last_batch"]
        epoch = counters[_EPOCH]["current"]["processed"]
        return bool(last_of_epoch and max_epochs not in (None, -1) and epoch + 1 >= max_epochs)

    def _settle_at_epoch_start(self, on_run_start: Callable[[Any], None]) -> Callable[[Any], None]:
        def on_run_start_settled(data_fetcher: Any) -> None:
            if self.settle_at is Settle.STREAMS_AT_EPOCH_START:
                self._set_joining_streams()
            on_run_start(data_fetcher)
            if self.settle_at is Settle.EPOCH_START and self.progress.pending is not None:
                # every counter now, so that the epoch loop sees its last batch done and ends at once
                self._joined(self.progress.pending, data_fetcher)
            self.settle_at = Settle.FIRST_WINDOW

        return on_run_start_settled

    def _set_joining_streams(self) -> None:
        if self.joining_rng is not None:
            set_rng_state(self.joining_rng)
            self.joining_rng = None

    # ------------------------------------------------------------------ one window

    def _advance(self, advance: Callable[[Any], None]) -> Callable[[Any], None]:
        def guarded_advance(data_fetcher: Any) -> None:
            rec = self.rec
            if not self.open:
                self._begin(data_fetcher)
            self.fetcher = _Fetcher(data_fetcher, self)
            rec.in_guard = True
            self.recovered_in_window = False
            try:
                advance(self.fetcher)
            except StopIteration:
                raise
            except BaseException as exc:  # noqa: BLE001 - a peer's failure is recovered; the script's own is not
                self._failed(exc)

        return guarded_advance

    def _on_advance_end(self, on_advance_end: Callable[[Any], None]) -> Callable[[Any], None]:
        def guarded_on_advance_end(data_fetcher: Any) -> None:
            if self.recovered_in_window:
                self.recovered_in_window = False
                return  # the batch was interrupted and is redone (or the step was completed elsewhere)
            stepped = self.loop._batches_that_stepped  # noqa: SLF001 - raised here once the window's update ran
            try:
                on_advance_end(self.fetcher if self.fetcher is not None else data_fetcher)
            except BaseException as exc:  # noqa: BLE001 - as in advance
                self._failed(exc)
                self.recovered_in_window = False
                return
            if self.loop._batches_that_stepped != stepped:  # noqa: SLF001
                self._complete()

        return guarded_on_advance_end

    def _begin(self, data_fetcher: Any) -> None:
        from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

        if isinstance(data_fetcher, _DataLoaderIterDataFetcher):
            raise UnsupportedTrainer("a training_step taking dataloader_iter fetches its own batches, which a "
                                     f"redone window cannot replay. {_OTHERWISE}")
        rec = self.rec
        while True:
            if rec.generation != self.generation:
                self.generation = rec.generation  # recovered between windows: every rank goes on from here
            pending = self.progress.pending
            if pending is not None:
                self.progress.pending = None
                self._joined(pending, data_fetcher)
            self._set_joining_streams()  # as the replica's step began; Lightning drew since (iter())
            self.progress.thaw()
            step = self.loop._batches_that_stepped  # noqa: SLF001 - the optimizer steps completed
            if step != rec.next_step:
                raise RecoveryError(f"Lightning is at optimizer step {step} but the recovery resumes at step "
                                    f"{rec.next_step}: its progress did not travel (swiftrun.lightning)")
            if rec.begin_step(step):
                break
            rec.next_step = rec.recover()  # a failure between windows reached this rank as the window began
        self.open, self.step = True, step
        self.window = []
        self.modes = [module.training for module in self.trainer.lightning_module.modules()]
        self.began = time.monotonic()

    def _failed(self, exc: BaseException) -> None:
        rec = self.rec
        rec.in_guard = False
        if not rec.caused_by_peer_failure(exc):
            raise exc
        self._recover()

    def _recover(self) -> None:
        """After a peer's failure inside the window: its step's state is back (or a replica's), so the window is
        redone from its first batch with the batches fetched for it, or, completed elsewhere, left."""
        rec = self.rec
        fetched = self.window
        rec.next_step = rec.recover()
        self.generation = rec.generation
        self.recovered_in_window = True
        # a failure in the validation after the window's update left Lightning validating, its modules in eval mode
        # (their train() comes at the validation's end): as every window begins
        self.trainer.training = True
        if self.modes is not None:
            for module, training in zip(self.trainer.lightning_module.modules(), self.modes):
                module.training = training
        self.strategy.model.zero_grad(set_to_none=True)  # what the interrupted micro-batches accumulated
        if rec.next_step == self.step:
            self.replay = fetched + self.replay
            self.window = []
            self._redo()
        elif rec.next_step == self.step + 1:
            # a replica finished the step (its update included this rank's gradients): its state, counters
            # included, was received, and the window's batches are all fetched (the update needed every rank's)
            self.open, self.replay, self.window = False, [], []
        else:
            raise RecoveryError(f"the recovery resumes at step {rec.next_step} while this rank was in step "
                                f"{self.step}: swiftrun.lightning redoes only the step in progress")
        if self.fetch_draws:
            warn(f"recovery {rec.generation} is not exact: the redone window's batches were fetched once, and "
                 "fetching them drew from the global RNG (a random augmentation without DataLoader workers)")

    def _redo(self) -> None:
        """Begin the step again at once: its state is as it began (the recovery put it back)."""
        rec = self.rec
        if not rec.begin_step(self.step):
            raise RecoveryError(f"step {self.step} could not begin again after recovery {rec.generation}")
        self.open = True
        self.began = time.monotonic()

    def _complete(self) -> None:
        rec = self.rec
        rec.in_guard = False
        if rec.aborted():  # the window ran to its end although the generation was aborted: redo it
            self._recover()
            return
        self.open = False
        rec.complete_step(self.step)
        self.progress.freeze()
        loss = self.trainer.callback_metrics.get("train_loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            rec.last_loss = float(loss)
        rec.link.set_status(self.step, loss=rec.last_loss, step_time=time.monotonic() - self.began)

    # ------------------------------------------------------------------ a replacement's first window

    def _joined(self, progress: dict[str, Any], data_fetcher: Any) -> None:
        """Take the counters the replica had as this window began (the replacement, which started its epoch at the
        recovered position); a survivor's own loops are where the others' are and keep their counters."""
        if not self.progress.fresh:
            self.progress.load_extras(progress)
            return
        # positioned at the next epoch's start, unless it runs the replica's epoch end itself
        self._take_received(progress, data_fetcher, convert=self.settle_at is not Settle.EPOCH_START)

    def _take_received(self, progress: dict[str, Any], data_fetcher: Any = None, convert: bool = True) -> None:
        """A replacement takes everything it received (once): counters, extras and streams."""
        self.progress.fresh = False
        self.progress.pending = None
        counters = progress["counters"]
        if convert and _ended_epoch(progress):
            counters = _next_epoch(counters)
        self.progress.load_counters(counters)
        self.progress.load_extras(progress)
        if data_fetcher is not None:  # Lightning counts the epoch's batches to know the last one
            data_fetcher.fetched += counters[_BATCH]["current"]["ready"]
        self._set_joining_streams()

    # ------------------------------------------------------------------ the end

    def _fit_run(self, run: Callable[[], None]) -> Callable[[], None]:
        def fit_run() -> None:
            run()
            if self.progress.pending is not None and self.progress.fresh:
                # a replacement whose loop never reached a window or an epoch: what it received is its state
                self._take_received(self.progress.pending, convert=False)
            self.finish()  # fit's loop ended normally (also a replacement that joined after the last step)

        return fit_run

    def finish(self) -> None:
        """Every rank waits for the others once fit's loop is done, so that a late failure is still repaired."""
        rec = self.rec
        if rec is None or rec.released:
            return
        if self.open:
            rec.in_guard = False
        while True:
            if rec.generation != self.generation:
                self.generation = rec.generation
            resumed = rec.finish(rec.completed + 1)
            if resumed is None:
                return
            if resumed != rec.completed + 1:
                raise RecoveryError(f"a failure at the end of training resumes at step {resumed}, which this rank "
                                    f"has left (swiftrun.lightning)")

    def watch_fetch(self) -> bool:
        return not self.fetch_draws

    def saw_fetch_draw(self) -> None:
        self.fetch_draws = True
        warn("Lightning's data pipeline draws from the global RNG while it fetches a batch (a random augmentation "
             "in the dataset or collate_fn, without DataLoader workers): a window redone after a recovery replays "
             "its batches and does not draw again, so a recovery of this job is not exact")


def _refuse_unsupported(trainer: Any) -> None:
    module = trainer.lightning_module
    if not module.automatic_optimization and len(trainer.strategy.optimizers) > 1:
        raise UnsupportedTrainer("swiftrun.lightning recovers manual optimization with one optimizer: with several, "
                                 f"an optimizer step is not one window. {_OTHERWISE}")


def _validates(trainer: Any) -> bool:
    """Whether fit() may run a validation (the module has a validation_step and validation is not switched off)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    return bool(is_overridden("validation_step", trainer.lightning_module) and trainer.limit_val_batches != 0)


def _ended_epoch(progress: dict[str, Any]) -> bool:
    """Whether the progress is as its step ended the epoch (a replica between windows, before the epoch's end)."""
    return bool(progress["ended"] and progress["counters"][_BATCH]["is_last_batch"])


def _next_epoch(counters: dict[str, Any]) -> dict[str, Any]:
    """Counters at the next epoch's first window, from those at the end of the previous epoch's last: what the
    epoch's end and the next one's start change, done with Lightning's own progress methods."""
    from lightning.pytorch.loops.progress import _BatchProgress, _OptimizationProgress, _Progress, _SchedulerProgress

    out = copy.deepcopy(counters)
    epoch = _Progress()
    epoch.load_state_dict(out["fit_loop.epoch_progress"])
    epoch.increment_processed()
    epoch.increment_completed()
    epoch.increment_ready()
    epoch.increment_started()
    out["fit_loop.epoch_progress"] = epoch.state_dict()
    for key, kind in (("fit_loop.epoch_loop.batch_progress", _BatchProgress),
                      ("fit_loop.epoch_loop.scheduler_progress", _SchedulerProgress),
                      ("fit_loop.epoch_loop.automatic_optimization.optim_progress", _OptimizationProgress)):
        if key in out:
            tracker = kind()
            tracker.load_state_dict(out[key])
            tracker.reset_on_run()
            out[key] = tracker.state_dict()
    val = "fit_loop.epoch_loop.val_loop.batch_progress"
    if val in out:
        tracker = _BatchProgress()
        tracker.load_state_dict(out[val])
        tracker.total.reset()
        out[val] = tracker.state_dict()
    return out


class _Fetcher:
    """Lightning's data fetcher as the wrapped loop sees it: a redone window's batches first, from memory, then the
    fetcher's own; every batch handed out is kept until the window's step completes."""

    def __init__(self, fetcher: Any, driver: Driver) -> None:
        self._fetcher = fetcher
        self._driver = driver
        self._done: bool | None = None

    def __iter__(self) -> _Fetcher:
        return self

    def __next__(self) -> Any:
        driver = self._driver
        if driver.replay:
            item, done = driver.replay.pop(0)
        else:
            watched = torch.get_rng_state() if driver.watch_fetch() else None
            item = next(self._fetcher)
            done = bool(self._fetcher.done)
            if watched is not None and not torch.equal(watched, torch.get_rng_state()):
                driver.saw_fetch_draw()
        driver.window.append((item, done))
        self._done = done
        return item

    @property
    def done(self) -> bool:
        return self._fetcher.done if self._done is None else self._done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fetcher, name)


class _Progress:
    """Lightning's own progress as swiftrun user state: snapshotted at each window's start, restored when a window
    is redone, copied to a replacement.

    ``counters`` are the loops' progress trackers (every ``_BaseProgress`` reachable from the fit loop) and
    ``_batches_that_stepped``; ``extras`` what a Lightning checkpoint carries for the callbacks and the module.
    Between windows what travels is the state as the last window ended (:meth:`freeze`): a survivor's loops are
    then past it (an epoch's end) and keep their own counters, and a replacement derives the next window's."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.frozen: dict[str, Any] | None = None
        self.pending: dict[str, Any] | None = None  # received outside a window: applied as the next one begins
        self.fresh = True  # a replacement's loops, not yet positioned

    @property
    def trainer(self) -> Any:
        return self.driver.trainer

    def freeze(self) -> None:
        self.frozen = dict(copy.deepcopy(self._live()), ended=True)

    def thaw(self) -> None:
        self.frozen = None

    def state_dict(self) -> dict[str, Any]:
        if self.pending is not None:  # received: what this rank's loops take as its next window begins
            return self.pending
        return self.frozen if self.frozen is not None else self._live()

    def _live(self) -> dict[str, Any]:
        counters = {name: tracker.state_dict() for name, tracker in _trackers(self.trainer.fit_loop, "fit_loop")}
        counters[_STEPPED] = self.driver.loop._batches_that_stepped  # noqa: SLF001
        return {"counters": counters, "extras": self._extras(), "ended": False}

    def _extras(self) -> dict[str, Any]:
        from lightning.pytorch.trainer import call

        trainer = self.trainer
        checkpoint: dict[str, Any] = {"callbacks": _callback_states(trainer)}
        call._call_callbacks_on_save_checkpoint(trainer, checkpoint)  # noqa: SLF001
        module: dict[str, Any] = {}
        trainer.lightning_module.on_save_checkpoint(module)
        checkpoint["module"] = module
        # every rank works its loggers' version out from the log directory as it starts (version_0 if empty); a
        # replacement starting later would find the survivors' directory and take the next one
        checkpoint["loggers"] = [logger.version for logger in trainer.loggers]
        return checkpoint

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.frozen = None
        if self.driver.open:  # inside a window: its own start, or a replica's state after the step
            self.load_counters(sd["counters"])
            self.load_extras(sd)
            if sd.get("ended"):
                self.frozen = copy.deepcopy(sd)
            return
        self.pending = copy.deepcopy(sd)

    def load_counters(self, counters: dict[str, Any]) -> None:
        for name, tracker in _trackers(self.trainer.fit_loop, "fit_loop"):
            if name in counters:
                tracker.load_state_dict(copy.deepcopy(counters[name]))
        self.driver.loop._batches_that_stepped = counters[_STEPPED]  # noqa: SLF001

    def load_extras(self, sd: dict[str, Any]) -> None:
        from lightning.pytorch.trainer import call

        trainer = self.trainer
        checkpoint = copy.deepcopy(sd["extras"])
        checkpoint.setdefault("pytorch-lightning_version", TESTED)
        for logger, version in zip(trainer.loggers, checkpoint.get("loggers", ())):
            if hasattr(logger, "_version") and logger.version != version:
                logger._version = version  # noqa: SLF001 - the version a logger takes when it is given one
                if hasattr(logger, "_experiment"):
                    logger._experiment = None  # noqa: SLF001 - made again in that version's directory (appended)
        _same_checkpoint_directory(trainer, checkpoint["callbacks"])
        call._call_callbacks_on_load_checkpoint(trainer, checkpoint)  # noqa: SLF001
        call._call_callbacks_load_state_dict(trainer, checkpoint)  # noqa: SLF001
        trainer.lightning_module.on_load_checkpoint(checkpoint["module"])


def _callback_states(trainer: Any) -> dict[str, Any]:
    """Every callback's ``state_dict``, ModelCheckpoint's but its directory left out. Its bookkeeping of the files
    it saved changes in the save at an epoch's end, between windows, where a recovery may cut it on one rank and
    not on another; the replicas would then differ in it for good, and a recovery is refused when replicas
    differ. So a replacement keeps its own (said in docs/guide/frameworks.md)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer import call

    states = call._call_callbacks_state_dict(trainer)  # noqa: SLF001
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.state_key in states:
            states[callback.state_key] = {"dirpath": states[callback.state_key].get("dirpath")}
    return states


def _same_checkpoint_directory(trainer: Any, states: dict[str, Any]) -> None:
    """A ModelCheckpoint saves where its replica's does: its directory comes from the logger's version, which a
    replacement worked out on its own before it joined (what else it keeps is its own, see _callback_states)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.callbacks:
        state = states.pop(callback.state_key, None) if isinstance(callback, ModelCheckpoint) else None
        if state and state.get("dirpath"):
            callback.dirpath = state["dirpath"]


def _trackers(loop: Any, prefix: str) -> list[tuple[str, Any]]:
    """Every progress tracker of a loop and of the loops inside it, named by their attribute path."""
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress

    found: list[tuple[str, Any]] = []
    for name, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            found.append((f"{prefix}.{name}", value))
        elif isinstance(value, _Loop) and name != "trainer":
            found.extend(_trackers(value, f"{prefix}.{name}"))
    return found
