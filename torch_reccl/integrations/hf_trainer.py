"""A Hugging Face Transformers TrainerCallback that follows :class:`torch_reccl.policy.FaultPolicy`::

    from torch_reccl.integrations.hf_trainer import FaultPolicyCallback

    args = TrainingArguments(output_dir="out", save_strategy="steps", save_steps=500, ...)
    trainer = Trainer(model, args, callbacks=[FaultPolicyCallback(loggers=[...])], ...)
    trainer.train(resume_from_checkpoint=FaultPolicyCallback.resume_path("out"))

After every optimizer step every rank asks the policy (one broadcast). At
``checkpoint_and_exit`` the callback sets ``control.should_save``: the Trainer
writes its usual ``checkpoint-<step>`` (model, optimizer, scheduler, RNG and data
position), and once it is written (``on_save``, on every rank) the job exits with
code 75; at ``exit_now`` it exits at once. ``torchrun --max-restarts`` or the
scheduler starts it again and ``resume_path(output_dir)`` (True once a checkpoint
is there) makes ``trainer.train`` resume from the latest one. The checkpoint
interval is ``save_steps`` unless ``checkpoint_interval_steps`` is given; the
other keyword arguments go to FaultPolicy. Needs ``pip install transformers``.
"""
from __future__ import annotations

import glob
import os
from typing import List, Optional

from torch_reccl.integrations._sink import require

_transformers = require("transformers", "transformers", "hf_trainer")


class FaultPolicyCallback(_transformers.TrainerCallback):
    def __init__(self, checkpoint_interval_steps: Optional[int] = None,
                 loggers: Optional[List] = None, **policy_kwargs) -> None:
        self.checkpoint_interval_steps = checkpoint_interval_steps
        self.loggers = loggers
        self.policy_kwargs = policy_kwargs
        self.policy = None
        self.last_advice = None
        self._exit_after_save = None

    @staticmethod
    def resume_path(output_dir: str) -> Optional[bool]:
        """``True`` (resume from the latest checkpoint) once ``output_dir`` holds one, else None."""
        return True if glob.glob(os.path.join(output_dir, "checkpoint-*")) else None

    def _interval(self, args) -> int:
        if self.checkpoint_interval_steps is not None:
            return self.checkpoint_interval_steps
        if str(getattr(args.save_strategy, "value", args.save_strategy)) != "steps":
            raise ValueError("FaultPolicyCallback needs checkpoint_interval_steps, or "
                             "save_strategy='steps' with save_steps")
        if args.save_steps < 1 or args.save_steps != int(args.save_steps):
            raise ValueError(f"FaultPolicyCallback needs save_steps as a number of steps, got "
                             f"{args.save_steps} (a fraction of the run); pass "
                             f"checkpoint_interval_steps")
        return int(args.save_steps)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.policy is None:
            from torch_reccl.policy import FaultPolicy

            self.policy = FaultPolicy(self._interval(args), loggers=self.loggers,
                                      **self.policy_kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        advice = self.policy.step(state.global_step)
        self.last_advice = advice
        if advice.checkpoint:
            control.should_save = True
            control.should_training_stop = True
            self._exit_after_save = advice
        elif advice.exit:
            self.policy.exit_for_rescheduling(advice)
        return control

    def on_save(self, args, state, control, **kwargs):
        if self._exit_after_save is not None:
            self.policy.exit_for_rescheduling(self._exit_after_save)

    def on_train_end(self, args, state, control, **kwargs):
        if self.policy is not None:
            self.policy.close()
