"""swiftrun: a drop-in torchrun replacement that recovers failed ranks in place.

``import swiftrun`` stays cheap (no torch import) so the launcher starts fast; the training-side API is loaded
on first use:

- :class:`swiftrun.Run`: register what must survive a failure and drive the training loop;
- :class:`swiftrun.Stage`: a stage of a hand-written point-to-point pipeline, ``Run(pipeline=swiftrun.Stage(...))``;
- :class:`swiftrun.ResumableDistributedSampler`: a DistributedSampler that can resume at any step;
- :func:`swiftrun.report`: send extra metrics (tokens/s, learning rate) to the launcher's dashboard;
- :mod:`swiftrun.hf`: ``swiftrun.hf.recoverable(trainer)``, in-place recovery for the Hugging Face Trainer.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Run", "Stage", "ResumableDistributedSampler", "report", "under_swiftrun", "hf", "__version__"]

_LAZY = {
    "Run": ("swiftrun.runtime.api", "Run"),
    "Stage": ("swiftrun.runtime.pp.p2p", "Stage"),
    "ResumableDistributedSampler": ("swiftrun.runtime.sampler", "ResumableDistributedSampler"),
    "report": ("swiftrun.runtime.api", "report"),
    "under_swiftrun": ("swiftrun.runtime.worker.env", "under_swiftrun"),
    "hf": ("swiftrun.hf", None),  # a module: swiftrun.hf.recoverable(trainer)
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'swiftrun' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value
