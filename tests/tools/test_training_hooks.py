"""The FaultPolicy callbacks for PyTorch Lightning and Hugging Face Transformers, on CPU.

One process per framework, a tiny linear model: a failover event is handed to the
callback's policy after step 12 and the steps get three times slower (the
slowdown the policy measures). With a 10-step checkpoint interval and T_detect
outweighing the interval, the rule runs degraded to step 20, where the callback
saves through the framework's own checkpointing and the job leaves with exit code
75. A second run resumes from that checkpoint and finishes; for Transformers,
whose Trainer restores the data position and RNG, the final weights equal a
fault-free run's bit for bit. Each answer change is logged through a JSON-lines
sink with its inputs. (The event path from the library and the broadcast across
ranks are tests/pg/test_policy.py's.) Last, a Lightning DDP job of 2 ranks over
"reccl" under ``torchrun --max-restarts 1`` (tests/helpers/lightning_policy_job.py):
rank 1's NIC down after step 12 by inject_fault, every rank saves and exits 75 at
step 20, torchrun restarts the job, it resumes and ends with the fault-free
parameters bit for bit.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from torch_reccl.events import Event
from torch_reccl.integrations.jsonl import JsonlSink
from torch_reccl.policy import CHECKPOINT_AND_EXIT, RESCHEDULE_EXIT_CODE

from conftest import HELPERS, REPO

FAULT_AFTER, INTERVAL, STEPS = 12, 10, 40
POLICY = {"t_detect_s": 10.0, "t_reload_s": 0.1}
STEP_S = 0.01


class Fault:
    """Slows every step once on, as a failed-over job runs slower."""

    def __init__(self):
        self.on = False

    def strike(self, policy) -> None:
        self.on = True
        policy.observe(Event(kind="failover", time=time.time(), rank=0, nic="eth0", peer="",
                             reason="injected", detail="", connection=1))

    def work(self) -> None:
        time.sleep(STEP_S * (3 if self.on else 1))


def advice_records(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lightning_callback_checkpoints_exits_75_and_resumes(tmp_path):
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    from torch_reccl.integrations.lightning import FaultPolicyCallback

    fault = Fault()

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 1)
            self.first_step = None

        def training_step(self, batch, batch_idx):
            if self.first_step is None:
                self.first_step = self.trainer.global_step
            fault.work()
            x, y = batch
            return torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StrikeAt(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == FAULT_AFTER and not fault.on:
                fault.strike(policy.policy)

    def loader():
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g),
                                              torch.randn(64, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def trainer(callbacks):
        return pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False,
                          enable_model_summary=False, callbacks=callbacks)

    sink = JsonlSink(str(tmp_path / "advice.jsonl"))
    policy = FaultPolicyCallback(str(tmp_path / "ckpt"), INTERVAL, loggers=[sink], **POLICY)
    assert policy.resume_path() is None
    with pytest.raises(SystemExit) as exited:
        trainer([StrikeAt(), policy]).fit(Tiny(), loader())
    assert exited.value.code == RESCHEDULE_EXIT_CODE
    assert policy.last_advice.action == CHECKPOINT_AND_EXIT and policy.last_advice.step == 20
    saved = torch.load(policy.resume_path(), weights_only=False)
    assert saved["global_step"] == 20
    sink.close()
    records = advice_records(tmp_path / "advice.jsonl")
    assert records[-1]["action"] == CHECKPOINT_AND_EXIT and records[-1]["k_measured"]
    assert records[-1]["k"] > 1.5 and records[-1]["checkpoint_interval_steps"] == INTERVAL

    fault.on = False  # the restarted job runs on healthy hardware
    resumed = FaultPolicyCallback(str(tmp_path / "ckpt"), INTERVAL, **POLICY)
    model = Tiny()
    run = trainer([resumed])
    run.fit(model, loader(), ckpt_path=resumed.resume_path())
    assert model.first_step == 20 and run.global_step == STEPS


def test_transformers_callback_checkpoints_exits_75_and_resumes_to_the_same_weights(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from torch_reccl.integrations.hf_trainer import FaultPolicyCallback

    fault = Fault()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(8, 1)

        def forward(self, x, labels):
            fault.work()
            return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn((), generator=g)}
            for _ in range(64)]

    class StrikeAt(transformers.TrainerCallback):
        def __init__(self, policy):
            self.policy = policy

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == FAULT_AFTER and not fault.on:
                fault.strike(self.policy.policy)

    def train(output_dir, callbacks, resume=None):
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), max_steps=STEPS, save_strategy="steps",
            save_steps=INTERVAL, per_device_train_batch_size=4, learning_rate=0.01,
            report_to="none", use_cpu=True, disable_tqdm=True, logging_strategy="no", seed=0,
            dataloader_num_workers=0)
        model = Tiny()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return model, trainer

    reference, _ = train(tmp_path / "fault-free", [])

    out = tmp_path / "job"
    sink = JsonlSink(str(tmp_path / "advice.jsonl"))
    policy = FaultPolicyCallback(loggers=[sink], **POLICY)
    assert FaultPolicyCallback.resume_path(str(out)) is None
    with pytest.raises(SystemExit) as exited:
        train(out, [StrikeAt(policy), policy])
    assert exited.value.code == RESCHEDULE_EXIT_CODE
    assert policy.last_advice.action == CHECKPOINT_AND_EXIT and policy.last_advice.step == 20
    assert (out / "checkpoint-20").is_dir() and not (out / "checkpoint-30").exists()
    sink.close()
    records = advice_records(tmp_path / "advice.jsonl")
    assert records[-1]["action"] == CHECKPOINT_AND_EXIT and records[-1]["step"] == 20

    fault.on = False
    model, trainer = train(out, [FaultPolicyCallback(**POLICY)],
                           resume=FaultPolicyCallback.resume_path(str(out)))
    assert trainer.state.global_step == STEPS
    for mine, theirs in zip(model.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(mine, theirs)


def test_lightning_interval_comes_from_model_checkpoint_or_is_asked_for():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from torch_reccl.integrations.lightning import FaultPolicyCallback

    with_checkpoints = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                                  callbacks=[ModelCheckpoint(every_n_train_steps=25)])
    assert FaultPolicyCallback("ckpt")._interval(with_checkpoints) == 25
    without = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="every_n_train_steps"):
        FaultPolicyCallback("ckpt")._interval(without)


def lightning_job(tmp_path, *args, restarts=0):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", RECCL_NICS="127.0.0.1,127.0.0.2")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "--max-restarts", str(restarts),
               os.path.join(HELPERS, "lightning_policy_job.py"), "--dir", str(tmp_path), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{done.returncode}:\n{output}"
    return output


def final_digests(output) -> list:
    return sorted(re.findall(r"rank (\d): step 40 parameters sha256 ([0-9a-f]{64})", output))


@pytest.mark.timeout(240)
def test_lightning_ddp_job_over_reccl_restarts_through_torchrun_to_the_same_weights(tmp_path):
    pytest.importorskip("lightning.pytorch")
    clean = final_digests(lightning_job(tmp_path / "clean"))
    assert len(clean) == 2 and clean[0][1] == clean[1][1]
    output = lightning_job(tmp_path / "job", "--fault-step", "12", restarts=1)
    exits = re.findall(r"rank (\d): exiting for rescheduling at step (\d+) \((\w+);", output)
    assert sorted(exits) == [("0", "20", CHECKPOINT_AND_EXIT), ("1", "20", CHECKPOINT_AND_EXIT)]
    assert sorted(re.findall(r"rank (\d): resuming from reccl-reschedule.ckpt", output)) == ["0", "1"]
    assert final_digests(output) == clean
