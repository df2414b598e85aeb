"""A PyTorch Lightning job for tests/tools/test_training_hooks.py, run under torchrun:
DDP over the "reccl" backend on CPU, the FaultPolicyCallback in the loop.

Each rank's DistributedSampler yields 20 batches per epoch (no shuffling), so a
checkpoint at step 20 ends an epoch and a job that resumes from it sees exactly the
batches a fault-free job sees. With ``--fault-step N`` the first attempt takes rank
1's NIC lo:127.0.0.1 down (torch_reccl.inject_fault) after step N and its steps get
three times slower (loopback NICs share one link, so the failover itself costs no
bandwidth). At the end each rank prints its parameters' SHA-256.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time

import lightning.pytorch as pl
import torch

import torch_reccl
from torch_reccl.integrations.lightning import FaultPolicyCallback

STEP_S = 0.01


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=-1)
    args = parser.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    state = {"slow": False}

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(STEP_S * (3 if state["slow"] else 1))
            x, y = batch
            return torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Fault(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if first_attempt and trainer.global_step == args.fault_step and not state["slow"]:
                state["slow"] = True
                if trainer.global_rank == 1:
                    torch_reccl.inject_fault("lo:127.0.0.1", "down")

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(160, 8, generator=g),
                                          torch.randn(160, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # Lightning adds the sampler
    policy = FaultPolicyCallback(args.dir, 20, t_detect_s=10.0, t_reload_s=0.1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_steps=args.steps,
                         strategy=pl.strategies.DDPStrategy(process_group_backend="reccl"),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=True,
                         callbacks=[Fault(), policy])
    model = Tiny()
    resume = policy.resume_path()
    if resume:
        print(f"rank {trainer.global_rank}: resuming from {os.path.basename(resume)}", flush=True)
    trainer.fit(model, loader, ckpt_path=resume)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(f"rank {trainer.global_rank}: step {trainer.global_step} parameters sha256 "
          f"{digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
