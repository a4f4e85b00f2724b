"""swiftrun.hf.recoverable(trainer): what it accepts, that it changes nothing outside swiftrun, and the Trainer
progress it makes travel. A real transformers Trainer in one process on the CPU (its recovery runs in
tests/integration/test_hf.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from swiftrun.runtime.frameworks import hf  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        out = self.layer(x)
        return {"loss": ((out - labels) ** 2).mean(), "logits": out} if labels is not None else {"logits": out}


@pytest.fixture
def trainer(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          disable_tqdm=True)
    made = transformers.Trainer(model=Tiny(), args=args)
    yield made
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # process-wide singletons: leave none behind for other tests
    GradientState._reset_state()


def test_outside_swiftrun_the_trainer_is_returned_untouched(trainer):
    callbacks = list(trainer.callback_handler.callbacks)
    assert hf.recoverable(trainer) is trainer
    assert trainer.callback_handler.callbacks == callbacks
    assert "_run_epoch" not in vars(trainer) and "get_batch_samples" not in vars(trainer)


def test_a_transformers_release_before_5_is_refused_naming_it(trainer, monkeypatch):
    # the module the integration imports: transformers re-registers itself in sys.modules once a Trainer is made
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(hf.UnsupportedTrainer, match="transformers 4.57.1 has another"):
        hf.recoverable(trainer)


def test_anything_but_a_trainer_is_refused_by_name():
    with pytest.raises(hf.UnsupportedTrainer, match="takes a transformers.Trainer"):
        hf.recoverable(object())


def test_a_trainer_whose_epoch_loop_is_not_the_one_driven_is_refused_naming_what_lacks(trainer):
    class Custom(transformers.Trainer):
        def _run_epoch(self, model, epoch):  # another loop: positioning it through resume would be wrong
            raise AssertionError("never called")

    trainer.__class__ = Custom
    with pytest.raises(hf.UnsupportedTrainer, match=r"lacks _run_epoch\(train_dataloader=...\)"):
        hf.recoverable(trainer)


def test_progress_travels_without_the_per_rank_fields_and_comes_back_whole(trainer):
    trainer._tr_loss = torch.tensor(1.5)
    trainer._total_loss_scalar, trainer._globalstep_last_logged, trainer.current_flos = 3.0, 4, 7.0
    trainer.state.global_step, trainer.state.log_history = 5, [{"loss": 0.5, "step": 5}]
    trainer.state.is_world_process_zero = False
    progress = hf._Progress(trainer)
    sent = progress.state_dict()
    assert "is_world_process_zero" not in sent["state"] and "stateful_callbacks" not in sent["state"]

    receiver = hf._Progress(trainer)
    trainer._tr_loss, trainer.state.global_step, trainer.state.log_history = torch.tensor(0.0), 0, []
    receiver.load_state_dict({**sent, "tr_loss": torch.tensor(1.5)})
    assert trainer.state.global_step == 5 and trainer.state.log_history == [{"loss": 0.5, "step": 5}]
    assert float(trainer._tr_loss) == 1.5 and trainer._globalstep_last_logged == 4
    assert trainer.state.is_world_process_zero is False  # this rank's own, never a peer's


def test_a_recovery_between_steps_takes_every_rank_back_to_the_progress_as_the_step_ended(trainer):
    """After a step the Trainer logs (gathers, then resets the loss and appends to the history); a recovery in
    there skips the gathers, so the survivor goes back to the step's end, which is what a replacement received."""
    trainer._tr_loss = torch.tensor(2.0)
    trainer._total_loss_scalar, trainer._globalstep_last_logged = 0.0, 0  # made by train() before the first step
    trainer.control.should_log = True  # raised by the step's end for the log after it
    progress = hf._Progress(trainer)
    progress.freeze()
    assert progress.state_dict()["control"]["should_log"] is False  # that log is not redone
    trainer._tr_loss -= trainer._tr_loss  # the log ran, with a skipped gather
    trainer.state.log_history.append({"loss": 123.0})
    assert float(progress.state_dict()["tr_loss"]) == 2.0  # what travels from here: the step's end
    progress.back_to_step_end()
    assert float(trainer._tr_loss) == 2.0 and trainer.state.log_history == []
    assert progress.frozen is None and trainer.control.should_log is False


def test_import_swiftrun_does_not_import_transformers_and_swiftrun_hf_is_there():
    code = ("import sys, swiftrun; assert 'transformers' not in sys.modules and 'torch' not in sys.modules; "
            "assert callable(swiftrun.hf.recoverable)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
