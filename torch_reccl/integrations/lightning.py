"""A PyTorch Lightning Callback that follows :class:`torch_reccl.policy.FaultPolicy`::

    from torch_reccl.integrations.lightning import FaultPolicyCallback

    policy = FaultPolicyCallback(dirpath="ckpt", checkpoint_interval_steps=500,
                                 loggers=[torch_reccl.integrations.tensorboard.attach(...)])
    trainer = lightning.Trainer(..., callbacks=[policy])
    trainer.fit(model, ckpt_path=policy.resume_path())   # None on the first run

After every training batch every rank asks the policy (one broadcast); at
``checkpoint_and_exit`` every rank calls ``trainer.save_checkpoint`` into
``dirpath/reccl-reschedule.ckpt`` and at ``exit_now`` none does; then the job
exits with code 75 (``SystemExit`` through ``trainer.fit``, after Lightning's own
teardown), for ``torchrun --max-restarts`` or the scheduler to start it again.
``resume_path()`` names that checkpoint once it exists (or ``fallback``, e.g.
``"last"`` with a ModelCheckpoint), so the restarted job resumes from it.
``checkpoint_interval_steps`` defaults to a ModelCheckpoint's
``every_n_train_steps``. The other keyword arguments go to FaultPolicy. Needs
``pip install lightning``.
"""
from __future__ import annotations

import os
from typing import List, Optional

from torch_reccl.integrations._sink import require

RESCHEDULE_CHECKPOINT = "reccl-reschedule.ckpt"

_pl = require("lightning.pytorch", "lightning", "lightning")


class FaultPolicyCallback(_pl.Callback):
    def __init__(self, dirpath: str, checkpoint_interval_steps: Optional[int] = None,
                 loggers: Optional[List] = None, **policy_kwargs) -> None:
        super().__init__()
        self.dirpath = dirpath
        self.checkpoint_interval_steps = checkpoint_interval_steps
        self.loggers = loggers
        self.policy_kwargs = policy_kwargs
        self.policy = None
        self.last_advice = None

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.dirpath, RESCHEDULE_CHECKPOINT)

    def resume_path(self, fallback: Optional[str] = None) -> Optional[str]:
        """The rescheduling checkpoint where one was written, else ``fallback``."""
        return self.checkpoint_path if os.path.exists(self.checkpoint_path) else fallback

    def _interval(self, trainer) -> int:
        if self.checkpoint_interval_steps is not None:
            return self.checkpoint_interval_steps
        for callback in trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_train_steps", 0)
            if every:
                return every
        raise ValueError("FaultPolicyCallback needs checkpoint_interval_steps, or a ModelCheckpoint "
                         "with every_n_train_steps")

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or self.policy is not None:
            return
        from torch_reccl.policy import FaultPolicy

        # the strategy has made the process group by now
        self.policy = FaultPolicy(self._interval(trainer), loggers=self.loggers,
                                  **self.policy_kwargs)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        advice = self.policy.step(trainer.global_step)
        self.last_advice = advice
        if not advice.exit:
            return
        if advice.checkpoint:
            os.makedirs(self.dirpath, exist_ok=True)
            trainer.save_checkpoint(self.checkpoint_path)
        self.policy.exit_for_rescheduling(advice)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.policy is not None:
            self.policy.close()
