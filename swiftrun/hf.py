"""In-place recovery for the Hugging Face Trainer, in one line::

    trainer = swiftrun.hf.recoverable(Trainer(model=model, args=args, train_dataset=dataset))
    trainer.train()

See :func:`swiftrun.runtime.frameworks.hf.recoverable` and docs/guide/frameworks.md.
"""

from swiftrun.runtime.frameworks.hf import UnsupportedTrainer, recoverable

__all__ = ["recoverable", "UnsupportedTrainer"]
