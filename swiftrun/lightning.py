"""In-place recovery for PyTorch Lightning, in one line::

    trainer = lightning.Trainer(strategy=swiftrun.lightning.SwiftDDPStrategy(), ...)
    # or, once swiftrun.lightning is imported: Trainer(strategy="swift_ddp", ...)

``SwiftDDPStrategy`` is Lightning's ``DDPStrategy`` (same arguments, accepted by ``torch.compile`` support and
every ``isinstance`` check Lightning makes) that, under swiftrun, repairs a peer's failure in place and redoes the
optimizer step in flight. Under plain torchrun or as a single process it is ``DDPStrategy`` unchanged. See
:mod:`swiftrun.runtime.frameworks.lightning` and docs/guide/frameworks.md.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("swiftrun.lightning needs the lightning package: pip install 'swiftrun[lightning]' "
                      "(lightning 2.6.6 tested)") from exc

from swiftrun.runtime.frameworks.lightning import TESTED, Driver, UnsupportedTrainer, check_version
from swiftrun.runtime.worker import process

check_version(lightning.__version__)

__all__ = ["SwiftDDPStrategy", "UnsupportedTrainer", "TESTED"]


class SwiftDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose training recovers a peer's failure in place under swiftrun (see the module docstring)."""

    strategy_name = "swift_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._swiftrun: Driver | None = None

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.state.fn == TrainerFn.FITTING and process.current() is not None and self._swiftrun is None:
            driver = Driver(self, trainer)
            driver.start()
            self._swiftrun = driver if driver.rec is not None else None

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if self._swiftrun is not None and trainer is not None and trainer.training:
            return self._swiftrun.training_loader(dataloader)
        return dataloader


if SwiftDDPStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(SwiftDDPStrategy.strategy_name, SwiftDDPStrategy,
                              description="DDP recovered in place by swiftrun (swiftrun.lightning)")
