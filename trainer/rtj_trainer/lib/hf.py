"""`RtjCallback`: the library for a Hugging Face `Trainer` script (docs/byo.md, path 2).

    from rtj_trainer.lib.hf import RtjCallback, last_checkpoint
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RtjCallback()])
    trainer.train(resume_from_checkpoint=last_checkpoint(args.output_dir))

`Trainer` keeps its own checkpoints (`save_steps`, in `output_dir`: put it on the checkpoint volume,
`RTJ_CHECKPOINT_DIR`). The callback adds what the operator needs: a heartbeat, the step and the
loss after every step (hang detection, `kubectl get rtj`), each save reported as the job's newest
checkpoint, and the pod's stop turned into `Trainer`'s own save-and-stop at the step every rank
agreed on. Run the script under the operator (ft_launcher starts it like torchrun, so the process
group exists before training begins).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .run import Run, init


class RtjCallback(TrainerCallback):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self._loss: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run = init(None)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self._loss = float(logs["loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.run is not None
        if self.run.step(int(state.global_step), self._loss):
            # Every rank agreed: save this step the Trainer's way, then leave the loop.
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.committed(int(state.global_step), args.output_dir)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.finish()


def last_checkpoint(output_dir: str) -> str | None:
    """The newest `checkpoint-<step>` directory of `output_dir` to resume from (None: none)."""
    from transformers.trainer_utils import get_last_checkpoint

    try:
        found: str | None = get_last_checkpoint(output_dir)  # type: ignore[no-untyped-call]
    except FileNotFoundError:
        return None
    return found
