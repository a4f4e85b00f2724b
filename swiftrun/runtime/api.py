"""The few calls a training script makes to be recoverable in place.

    import swiftrun
    run = swiftrun.Run(model=ddp_model, optimizer=opt, scheduler=sched)   # what must survive a failure
    for step in run.steps(num_steps):                                     # after a recovery: the step to redo
        with run.guard():                                                 # a failure inside is recovered here
            loss = train_step(step)                                       # data must be a function of `step`
            run.report(loss=loss.item())                                  # optional telemetry

Under plain torchrun, or as a single process, the same calls are inert: ``steps`` is ``range``, ``guard`` does
nothing, ``report`` drops its arguments.

Under swiftrun, when any rank dies or hangs, the launcher aborts the process group of every survivor (a
collective blocked on the dead rank raises at once), starts a replacement for the dead rank, and each rank runs
:meth:`Run._recover`: rebuild the group of the new generation, agree on the recovery point
(:mod:`~swiftrun.runtime.dp.consensus`), undo a partially applied update where the plan says so, broadcast the
winning state to the ranks that need it, rebind DDP, and wait for the launcher's RESUME. The step that was
interrupted is then yielded again.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from swiftrun.runtime.worker import process


def report(**metrics: float) -> None:
    """Send extra metrics (tokens_per_s, lr...) to the launcher's dashboard and event log. Never blocks."""
    rt = process.current()
    if rt is None:
        return
    link = rt.link
    loss = metrics.pop("loss", None)
    link.set_status(link.step, loss=float(loss) if loss is not None else None,
                    metrics={k: float(v) for k, v in metrics.items()})


class Run:
    """Registers what must survive a failure and drives the training loop (see the module docstring).

    Args:
        model: the model: a DDP module, the module it wraps, a ``torch.compile``d one, or a list of them (a GAN's
            generator and discriminator). Every parameter and buffer travels to a replacement; every DDP wrapper
            is rebound to the rebuilt process group (DDP modules not passed here are found and registered too).
        optimizer: one optimizer or a list. Their state travels; their last step can be undone. What Accelerate's
            ``prepare()`` or Lightning Fabric's ``setup()`` returned may be passed as it is (the optimizer, the
            scheduler and the module inside are registered).
        scheduler: one LR scheduler or a list; state travels and is restored when a step is undone.
        scaler: a ``torch.amp.GradScaler``; a step it skipped is not undone.
        state: small user state that must travel: an object with ``state_dict``/``load_state_dict``, or a dict
            (updated in place on the receiving ranks).
        pipeline: this rank's pipeline stage(s): a ``torch.distributed.pipelining`` schedule (or its
            ``PipelineStage``) whose stage boundaries are logged, so that a stage without a data-parallel replica
            is rebuilt by replaying it from its last stage checkpoint (docs/ARCHITECTURE.md, "Pipelines"); or a
            :class:`swiftrun.Stage` when the script moves tensors between stages itself (``dist.isend``/``irecv``/
            ``send``/``recv``, ``batch_isend_irecv``).
        checkpoint_every: steps between a pipeline's stage checkpoints (kept in the next stage's memory); a
            lost stage replays at most this many steps. Default: ``SWIFTRUN_CKPT_EVERY`` or 20.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None,
                 state: Any = None, pipeline: Any = None, checkpoint_every: int | None = None) -> None:
        self._rt = process.current()
        self._next = 0
        self._total = 0
        self._step = -1
        self._recovery = None
        self.pipeline = pipeline
        if self._rt is None:
            return
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() < 2:
            self._rt = None  # nothing to recover from a replica: behave as under torchrun
            return
        from swiftrun.runtime.core.recovery import Recovery
        from swiftrun.runtime.state.registry import _as_list  # noqa: PLC2701

        self._recovery = Recovery(self._rt, model, _as_list(optimizer), _as_list(scheduler), scaler, state,
                                  strategy=_strategy(pipeline, checkpoint_every))
        self._next = self._recovery.start()

    @property
    def active(self) -> bool:
        """True when failures of this job are recovered in place (running under swiftrun with replicas)."""
        return self._recovery is not None

    @property
    def aborted(self) -> bool:
        """True in the rest of an iteration that a recovery interrupted: that step is redone by the next
        iteration, so code after the guard with side effects (saving a checkpoint labelled with the step) should
        skip when this is set. Always False under torchrun and as a single process."""
        return self._recovery is not None and self._recovery.aborted_iteration

    def steps(self, total: int, start: int = 0, loader: Any = None) -> Iterator[Any]:
        """Yield the step numbers ``start .. total-1``; after a recovery, the step to (re)do next.

        With ``loader`` (a DataLoader whose sampler is a :class:`~swiftrun.ResumableDistributedSampler`), yield
        ``(step, batch)`` instead: the sampler is positioned at every step it was not already at (the start, a
        new epoch, a recovery), so each step gets exactly the batch failure-free training would give it.
        """
        if loader is not None:
            cursor = _LoaderCursor(loader)
            for step in self.steps(total, start):
                yield step, cursor.batch_for(step)
            return
        if self._recovery is None:
            for step in range(start, total):
                self._step = step
                yield step
            return
        rec = self._recovery
        self._next = max(self._next, start)
        while True:
            while self._next < total:
                step = self._next
                if not rec.begin_step(step):
                    self._next = rec.recover()
                    continue
                self._step = step
                began = time.monotonic()
                yield step
                if rec.in_step:  # the body ran without a guard: reaching here means it completed
                    rec.complete_step(step)
                rec.link.set_status(step, loss=rec.last_loss, step_time=time.monotonic() - began)
                self._next = rec.next_step
            resumed = rec.finish(total)
            if resumed is None:
                return
            self._next = resumed

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Catch a failure of this step caused by a peer; recover in place; the step is then yielded again."""
        if self._recovery is None:
            yield
            return
        rec = self._recovery
        rec.in_guard = True
        try:
            yield
        except BaseException as exc:  # noqa: BLE001 - decided below: recover, or re-raise the user's own error
            rec.in_guard = False
            if not rec.caused_by_peer_failure(exc):
                raise
            rec.next_step = rec.recover()
            return
        rec.in_guard = False
        if rec.in_step and rec.aborted():
            # the body returned normally although the generation was aborted (the script caught the failed
            # collective itself): the step did not complete, so it is recovered and redone, never marked done
            rec.next_step = rec.recover()
            return
        if not rec.aborted_iteration:
            rec.complete_step(self._step)

    def report(self, loss: float | None = None, **metrics: float) -> None:
        """Report this step's loss and extra metrics to the launcher (no-op outside swiftrun)."""
        if self._recovery is None:
            return
        rec = self._recovery
        if loss is not None:
            rec.last_loss = float(loss)
        rec.link.set_status(self._step, loss=rec.last_loss, metrics={k: float(v) for k, v in metrics.items()})


class _LoaderCursor:
    """Hands out the batch of a given step from a DataLoader over a resumable sampler."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        sampler = getattr(loader, "sampler", None)
        if not hasattr(sampler, "seek"):
            sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        if not hasattr(sampler, "seek") or not loader.batch_size:
            raise TypeError("Run.steps(loader=...) needs a DataLoader with a batch_size and a "
                            "swiftrun.ResumableDistributedSampler as its sampler")
        self.sampler = sampler
        self.batch_size = int(loader.batch_size)
        if getattr(loader, "num_workers", 0) > 0 and not isinstance(loader.dataset, _PerSampleSeeds):
            # a worker's RNG advances with every sample it loads, and which worker loads which batch depends on
            # where the iterator started: seed each sample from its index so random augmentation does not
            object.__setattr__(loader, "dataset", _PerSampleSeeds(loader.dataset))
        self._iterator: Iterator[Any] | None = None
        self._next_step: int | None = None

    def _seek(self, step: int) -> None:
        """Position the sampler at ``step``'s batch. Steps count batches, and an epoch has a whole number of
        them (its last batch shorter, or dropped with drop_last), so the position is worked out per epoch.

        ``iter(DataLoader)`` draws its workers' base seed from the loader's generator, or from the global torch
        RNG when it has none; either would make a re-created iterator (after a recovery) differ from the one
        failure-free training created at the epoch's start. So the base seed is a function of the sampler's seed
        and the epoch, set through a generator of our own before every ``iter()``."""
        per_epoch = len(self.sampler)
        full, rest = divmod(per_epoch, self.batch_size)
        batches = full if getattr(self.loader, "drop_last", False) or rest == 0 else full + 1
        if batches == 0:
            raise ValueError("the DataLoader yields no batch per epoch")
        epoch, index = divmod(step, batches)
        self.sampler.seek(epoch * per_epoch + index * self.batch_size)
        self.loader.generator = _epoch_generator(int(getattr(self.sampler, "seed", 0)), epoch)
        self._iterator = iter(self.loader)

    def batch_for(self, step: int) -> Any:
        if step != self._next_step or self._iterator is None:
            self._seek(step)
        assert self._iterator is not None
        try:
            batch = next(self._iterator)
        except StopIteration:  # the epoch ended: the next one starts with this step
            self._seek(step)
            batch = next(self._iterator)
        self._next_step = step + 1
        return batch


def _epoch_generator(seed: int, epoch: int) -> Any:
    import torch

    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)


class _PerSampleSeeds:
    """A map-style dataset whose samples, loaded in a DataLoader worker, see RNGs seeded from (worker base seed
    of the epoch, sample index): the same random draws whichever worker loads the sample and whenever."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is not None:
            import random

            import torch

            seed = ((info.seed - info.id) * 1_000_003 + int(index)) & 0xFFFF_FFFF
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                import numpy as np

                np.random.seed(seed)
            except ImportError:
                pass
        return self.dataset[index]

    def __getattr__(self, name: str) -> Any:
        if name in ("__getitems__", "dataset"):  # per-sample fetching, so every sample is seeded
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _strategy(pipeline: Any, checkpoint_every: int | None) -> Callable[[Any], Any]:
    """The recovery strategy of this job's kind of parallelism, chosen once (runtime/core/strategy.py)."""
    if pipeline is not None:
        from swiftrun.runtime.pp.recovery import PipelineRecovery

        return lambda rec: PipelineRecovery(rec, pipeline, checkpoint_every)
    from swiftrun.runtime.dp.recovery import DataParallel
    from swiftrun.runtime.hsdp.recovery import ShardedDataParallel
    from swiftrun.runtime.state.layout import is_sharded

    # FSDP2/DTensor parameters: each rank's shards come from its replica set (HSDP); otherwise every rank is a replica
    return lambda rec: ShardedDataParallel(rec) if is_sharded(rec.reg) else DataParallel(rec)
