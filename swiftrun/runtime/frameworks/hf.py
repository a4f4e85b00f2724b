"""In-place recovery for the Hugging Face Trainer: ``swiftrun.hf.recoverable(trainer)``.

The Trainer owns its training loop, so the step protocol (``runtime/core/recovery.py``) is driven from four
places in it (transformers 5.x, ``trainer.py``):

- a callback's ``on_train_begin``: the DDP model, the optimizer, the scheduler and the loss accumulator exist now,
  so ``swiftrun.Run`` is made here (a replacement recovers inside it and learns the step it must redo);
- ``get_batch_samples``, called once per optimizer step before the accumulation window's batches are fetched:
  the step begins here, so its snapshot (RNG included) precedes the fetch, as the window is the step;
- the callback's ``on_step_end``, after the update, the scheduler's step and ``global_step += 1``: it is complete;
- ``_run_epoch``: a failure caused by a peer leaves the epoch through it. The wrapper recovers and re-enters the
  epoch at the step to redo, positioned by the Trainer's own resume path (``skip_first_batches`` past the windows
  already done) instead of a checkpoint.

Why re-enter rather than redo the step inside the loop: the Trainer keeps the epoch's iterator and the fetched
window in locals of ``_run_epoch``, so only a new pass over the epoch gives the redone step exactly its batches.
A re-entered epoch makes a new iterator, which draws from the global RNG; the step's RNG is set back after it.

Every rank re-enters after every recovery, even one that found it between steps with nothing to redo, so that the
collectives an iterator issues when it is made (Accelerate synchronises a sampler's generator) match the
replacement's, which enters its epoch for the first time.

What travels besides the model, optimizer and scheduler (:class:`_Progress`): the ``TrainerState`` but the fields
that differ per rank, the ``TrainerControl``, the loss accumulated since the last log, the FLOP count and the
attributes of stateful callbacks (``ExportableState``). What does not: a checkpoint save, an evaluation or a log
cut by a recovery (their collectives are skipped with a warning: docs/guide/frameworks.md).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from typing import Any, Callable

import torch

from swiftrun.errors import RecoveryError
from swiftrun.runtime.api import Run
from swiftrun.runtime.core.txn import rng_state, set_rng_state
from swiftrun.runtime.worker import process
from swiftrun.runtime.worker.process import notice, warn

# what the integration reads and replaces; checked at recoverable(), so that another Trainer fails there, clearly
_EPOCH_PARAMETERS = ("epoch", "train_dataloader", "resume_from_checkpoint", "epochs_trained",
                     "steps_trained_in_current_epoch")
_METHODS = ("_run_epoch", "get_batch_samples", "_load_rng_state", "add_callback")
# TrainerState fields not copied from a peer: the ones that differ per rank, and the callback objects themselves
# (their attributes travel on their own, see _Progress)
_NOT_COPIED = frozenset({"is_local_process_zero", "is_world_process_zero", "stateful_callbacks"})
# passed as resume_from_checkpoint to re-enter an epoch at a step: the Trainer's resume path with no file to read
_POSITIONED = "<positioned by a swiftrun recovery>"
# the way out a refusal offers
_OTHERWISE = "or train under swiftrun without recoverable(): a failure then restarts every worker (--max-restarts)"


class UnsupportedTrainer(TypeError):
    """The trainer is not one whose loop this integration knows how to drive (said at recoverable())."""


def recoverable(trainer: Any) -> Any:
    """Make a ``transformers.Trainer`` (or a subclass: ``Seq2SeqTrainer``, TRL's ``SFTTrainer``) recover a peer's
    failure in place; returns the same trainer.

    Under swiftrun, a rank that dies or hangs is replaced and ``trainer.train()`` goes on: the optimizer step in
    flight (its whole gradient-accumulation window) is redone with the same batches, and the replacement gets the
    model, optimizer, scheduler, ``TrainerState`` and RNG from its replica instead of a checkpoint. Under plain
    torchrun or as a single process the trainer is returned untouched.
    """
    _check(trainer)
    if getattr(trainer, "_swiftrun_driver", None) is not None:
        return trainer
    if process.current() is None:
        return trainer  # torchrun, a single process: nothing to recover, nothing changed
    driver = _Driver(trainer)
    trainer._swiftrun_driver = driver
    trainer.add_callback(_callback_class()(driver))
    trainer._run_epoch = driver.wrap_epoch(trainer._run_epoch)
    trainer.get_batch_samples = driver.wrap_batches(trainer.get_batch_samples)
    trainer._load_rng_state = driver.wrap_rng_load(trainer._load_rng_state)
    return trainer


def _check(trainer: Any) -> None:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - the caller built a Trainer
        raise UnsupportedTrainer("swiftrun.hf needs transformers installed") from exc
    version = getattr(transformers, "__version__", "?")
    major = version.split(".", 1)[0]
    if major.isdigit() and int(major) < 5:
        raise UnsupportedTrainer(f"swiftrun.hf drives the Trainer loop of transformers 5.x (5.23.0 tested); "
                                 f"transformers {version} has another. Upgrade transformers, {_OTHERWISE}")
    if not isinstance(trainer, transformers.Trainer):
        raise UnsupportedTrainer(f"swiftrun.hf.recoverable() takes a transformers.Trainer, not {type(trainer)!r}")
    missing = [name for name in _METHODS if not callable(getattr(trainer, name, None))]
    if not missing:
        params = inspect.signature(trainer._run_epoch).parameters
        missing = [f"_run_epoch({name}=...)" for name in _EPOCH_PARAMETERS if name not in params]
    if missing:
        raise UnsupportedTrainer(f"swiftrun.hf drives the Trainer loop of transformers 5.x; transformers {version} "
                                 f"lacks {', '.join(missing)}. Use a transformers release >= 5.0, {_OTHERWISE}")
    if getattr(trainer.args, "gradient_accumulation_steps", 1) < 1:
        raise UnsupportedTrainer("gradient_accumulation_steps must be at least 1")


class _Rewind(Exception):
    """Leave the epoch from inside the Trainer's loop and re-enter it at the step to redo."""


class _Driver:
    """Drives one rank's step protocol from the hooks in the Trainer (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.run: Run | None = None
        self.generation = -1
        self.repositioned = False  # a recovery happened: epochs are entered at the step the recovery chose
        self.step_rng: dict[str, Any] | None = None  # the RNG the step re-entered after a recovery starts with
        self.updates_per_epoch = 0
        self.draws_while_fetching = False  # seen on this rank: a recovery cannot give a redone window its draws
        self.began = 0.0
        self.progress = _Progress(trainer)

    @property
    def rec(self) -> Any:
        return self.run._recovery if self.run is not None else None  # noqa: SLF001 - the runtime's own API

    # ------------------------------------------------------------------ training begins

    def start(self) -> None:
        trainer = self.trainer
        rt = process.current()
        joining = bool(rt is not None and rt.wenv.joining)
        first_generation = rt.wenv.generation if rt is not None else 0
        self.run = Run(model=trainer.model_wrapped, optimizer=trainer.optimizer, scheduler=trainer.lr_scheduler,
                       scaler=getattr(trainer.accelerator, "scaler", None), state=self.progress)
        rec = self.rec
        if rec is None:
            return
        self.generation = rec.generation
        if trainer.args.dataloader_num_workers > 0 and rec.rank == 0:
            notice("DataLoader workers are seeded when an epoch's iterator is made, and a step redone after a "
                   "recovery re-enters its epoch with a new one: random augmentations in the workers then differ "
                   "from a failure-free run (a deterministic dataset is unaffected)")
        if joining or rec.generation != first_generation:
            self._recovered()

    # ------------------------------------------------------------------ one optimizer step

    def wrap_batches(self, fetch: Callable[..., Any]) -> Callable[..., Any]:
        def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            if self.rec is None:
                return fetch(epoch_iterator, num_batches, device)
            after = self._begin()
            watched = torch.get_rng_state() if after is None and self._watching() else None
            got = fetch(epoch_iterator, num_batches, device)
            if after is not None:
                set_rng_state(after)
            elif watched is not None and not torch.equal(watched, torch.get_rng_state()):
                self._fetch_draws()
            return got

        return get_batch_samples

    def _begin(self) -> dict[str, Any] | None:
        """Begin the step the Trainer is at; returns the RNG to set again once its window is fetched (a step
        re-entered mid-epoch: the epoch's new iterator draws from the RNG at its first batch)."""
        rec, state = self.rec, self.trainer.state
        if rec.generation != self.generation:
            # a collective between steps (a log's gather) was recovered where it failed: enter the epoch again,
            # as every other rank does after this recovery
            self._recovered()
            raise _Rewind
        after = None
        if self.step_rng is not None:
            # failure-free, the epoch's first window makes the iterator (one draw) after the step's start; a window
            # later in the epoch draws nothing
            set_rng_state(self.step_rng)
            if not self._epoch_start():
                after = self.step_rng
            self.step_rng = None
        self.progress.thaw()  # the step's snapshot takes what the log, save or evaluation after the last one did
        step = state.global_step
        if step != rec.next_step:
            raise RecoveryError(f"the Trainer is at global step {step} but the recovery resumes at step "
                                f"{rec.next_step}: its state did not travel (swiftrun.hf)")
        if not rec.begin_step(step):
            rec.next_step = rec.recover()
            self._recovered()
            raise _Rewind
        rec.in_guard = True  # the whole window is the guarded body: a peer's failure in it is recovered
        self.began = time.monotonic()
        return after

    def _epoch_start(self) -> bool:
        return self.updates_per_epoch <= 0 or self.trainer.state.global_step % self.updates_per_epoch == 0

    def _watching(self) -> bool:
        """Whether to watch this window's fetch for RNG draws: a window inside the epoch, until one is seen."""
        return not self.draws_while_fetching and not self._epoch_start()

    def _fetch_draws(self) -> None:
        self.draws_while_fetching = True
        warn("the Trainer's data pipeline draws from the global RNG while it fetches a window (a random "
             "augmentation in the dataset or collator, without DataLoader workers): a step redone after a "
             "recovery re-enters its epoch and gets different draws, so a recovery of this job is not exact")

    def complete(self) -> None:
        rec = self.rec
        if rec is None or not rec.in_step:
            return
        rec.in_guard = False
        if rec.aborted():  # the step ran to its end although the generation was aborted: redo it
            rec.next_step = rec.recover()
            self._recovered()
            raise _Rewind
        step = rec.step
        rec.complete_step(step)
        self.progress.freeze()
        rec.link.set_status(step, loss=rec.last_loss, step_time=time.monotonic() - self.began)

    def log(self, logs: dict[str, Any]) -> None:
        rec = self.rec
        if rec is not None and isinstance(logs.get("loss"), (int, float)):
            rec.last_loss = float(logs["loss"])

    # ------------------------------------------------------------------ epochs, recoveries and the end

    def wrap_epoch(self, run_epoch: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(run_epoch)

        def _run_epoch(*args: Any, **kwargs: Any) -> Any:
            if self.rec is None:
                return run_epoch(*args, **kwargs)
            return self._epochs(run_epoch, dict(signature.bind(*args, **kwargs).arguments))

        return _run_epoch

    def _epochs(self, run_epoch: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        """Run the Trainer's epoch ``kwargs["epoch"]``, and after a recovery whatever the recovery put back before
        it: the tail of an earlier epoch when an undone step crossed the boundary, then this epoch."""
        epoch, trainer = kwargs["epoch"], self.trainer
        self.updates_per_epoch = kwargs["num_update_steps_per_epoch"]
        while True:
            state = trainer.state
            at_end = state.global_step >= state.max_steps
            first, offset = self._position(kwargs["steps_in_epoch"], kwargs["num_update_steps_per_epoch"])
            if self.repositioned and first > epoch and not at_end:
                return  # a replacement fast-forwarding: this epoch is behind the state it received
            try:
                if not at_end:
                    self._run_epochs(run_epoch, kwargs, first if self.repositioned else epoch, offset)
                if trainer.control.should_training_stop or epoch + 1 >= state.num_train_epochs or at_end:
                    if self.rec.generation != self.generation:
                        self._recovered()  # recovered after the last step: take the progress the others have
                    resumed = self.rec.finish(state.max_steps)
                    if resumed is not None:  # a failure before every rank finished: repaired, go on from there
                        self.rec.next_step = resumed
                        self._recovered()
                        continue
                return
            except _Rewind:
                continue
            except BaseException as exc:  # noqa: BLE001 - a peer's failure is recovered; the script's own is not
                rec = self.rec
                rec.in_guard = False
                if not rec.caused_by_peer_failure(exc):
                    raise
                rec.next_step = rec.recover()
                self._recovered()

    def _run_epochs(self, run_epoch: Callable[..., Any], kwargs: dict[str, Any], first: int, offset: int) -> None:
        """Epochs ``first .. kwargs["epoch"]``; after a recovery the first is entered at ``offset`` batches."""
        for current in range(first, kwargs["epoch"] + 1):
            call = dict(kwargs, epoch=current)
            if self.repositioned:
                # the Trainer's resume path, with the position the recovery chose and no file to read
                call.update(resume_from_checkpoint=_POSITIONED, epochs_trained=current,
                            steps_trained_in_current_epoch=offset)
            run_epoch(**call)
            self.repositioned = False  # the epoch after a re-entered one starts at its own beginning
            if self.trainer.control.should_training_stop:
                return

    def _position(self, steps_in_epoch: int, updates_per_epoch: int) -> tuple[int, int]:
        """(epoch, batches into it) of the step to run next, as the Trainer computes a checkpoint's position."""
        step = self.trainer.state.global_step
        if updates_per_epoch <= 0:
            return 0, 0
        epoch, done = divmod(step, updates_per_epoch)
        accumulation = self.trainer.args.gradient_accumulation_steps
        return epoch, min(done * accumulation, steps_in_epoch)

    def _recovered(self) -> None:
        """After a recovery: the trainer's state is the redone step's start; re-enter the epoch there."""
        rec, trainer = self.rec, self.trainer
        self.progress.back_to_step_end()
        self.generation = rec.generation
        self.repositioned = True
        self.step_rng = rng_state()
        if self.draws_while_fetching:
            warn(f"recovery {rec.generation} is not exact: the redone step's window gets random draws of its own "
                 "(the data pipeline draws from the global RNG while fetching)")
        # gradients accumulated by the interrupted window; the Trainer zeroes them after each update, so a step
        # starts with none
        trainer.model_wrapped.zero_grad(set_to_none=True)

    def wrap_rng_load(self, load: Callable[[Any], None]) -> Callable[[Any], None]:
        def _load_rng_state(checkpoint: Any) -> None:
            if checkpoint == _POSITIONED:
                return  # the step's RNG is set when it begins (see _begin)
            load(checkpoint)

        return _load_rng_state


class _Progress:
    """The Trainer's own progress as swiftrun user state: snapshotted at each step start, restored when a step is
    redone, copied to a replacement.

    Between a step's end and the next step's start the Trainer logs, saves and evaluates, changing this state with
    collectives that a recovery there skips. What travels from there is the state as the step ended
    (:meth:`freeze`), and a survivor goes back to it, so every rank resumes from the same progress: the cut log's
    loss is reported with the next one's (its gathers were skipped, with a warning)."""

    # the flags a step's end raises for the log/save/evaluation after it: down again at the next step's start
    _AFTER_STEP = ("should_log", "should_save", "should_evaluate")

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.frozen: dict[str, Any] | None = None  # the progress as the last step ended, until the next begins

    def freeze(self) -> None:
        frozen = copy.deepcopy(self._live())
        frozen["control"].update(dict.fromkeys(self._AFTER_STEP, False))
        self.frozen = frozen

    def thaw(self) -> None:
        self.frozen = None

    def back_to_step_end(self) -> None:
        """A recovery between steps: take the progress the other ranks have (see the class docstring)."""
        if self.frozen is not None:
            self.load_state_dict(copy.deepcopy(self.frozen))

    def state_dict(self) -> dict[str, Any]:
        return self.frozen if self.frozen is not None else self._live()

    def _live(self) -> dict[str, Any]:
        t = self.trainer
        state = {f.name: getattr(t.state, f.name) for f in dataclasses.fields(t.state)
                 if f.name not in _NOT_COPIED}
        state["log_history"] = _History(t.state.log_history)
        return {
            "state": state,
            "control": dataclasses.asdict(t.control),
            "tr_loss": t._tr_loss,  # noqa: SLF001 - the loss summed since the last log
            "total_loss": t._total_loss_scalar,  # noqa: SLF001
            "last_logged": t._globalstep_last_logged,  # noqa: SLF001
            "flos": t.current_flos,
            "callbacks": {_callback_key(i, cb): dict(cb.state().get("attributes", {}))
                          for i, cb in enumerate(_stateful_callbacks(t))},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        self.frozen = None
        for name, value in sd["state"].items():
            setattr(t.state, name, list(value.entries) if isinstance(value, _History) else value)
        for name, value in sd["control"].items():
            setattr(t.control, name, value)
        t._tr_loss = sd["tr_loss"].to(t._tr_loss.device, copy=True)  # noqa: SLF001
        t._total_loss_scalar = sd["total_loss"]  # noqa: SLF001
        t._globalstep_last_logged = sd["last_logged"]  # noqa: SLF001
        t.current_flos = sd["flos"]
        for i, cb in enumerate(_stateful_callbacks(t)):
            for name, value in sd["callbacks"].get(_callback_key(i, cb), {}).items():
                setattr(cb, name, value)


class _History:
    """The Trainer's log history as one leaf of the progress. Its entries are appended and never changed, so a copy
    of the progress (each step start's snapshot, each step end's frozen copy) keeps references to them: deep-copying
    every entry made each step cost O(entries logged so far), +19% per update after 200 logged steps."""

    __slots__ = ("entries",)

    def __init__(self, entries: Any) -> None:
        self.entries = tuple(entries)

    def __deepcopy__(self, memo: dict) -> _History:
        return self  # immutable: a tuple of entries nobody changes

    def __reduce__(self) -> tuple:
        return _History, (self.entries,)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _History) and self.entries == other.entries

    __hash__ = None  # type: ignore[assignment]


def _stateful_callbacks(trainer: Any) -> list:
    from transformers.trainer_callback import ExportableState

    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, ExportableState)]


def _callback_key(index: int, callback: Any) -> str:
    return f"{index}.{type(callback).__name__}"


_CALLBACK: type | None = None


def _callback_class() -> type:
    """The callback that begins training and completes steps, made on first use (transformers is imported only
    by a script that uses it)."""
    global _CALLBACK
    if _CALLBACK is None:
        from transformers import TrainerCallback

        class SwiftrunCallback(TrainerCallback):
            def __init__(self, driver: _Driver) -> None:
                self.driver = driver

            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.driver.start()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.driver.complete()

            def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
                self.driver.log(logs or {})

        _CALLBACK = SwiftrunCallback
    return _CALLBACK
