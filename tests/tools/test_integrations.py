"""The integrations, each read back from what the tool itself wrote or serves.

Events come from real failovers: a connection over two loopback NICs whose primary
is failed with inject_fault and then healed. Every sink is compared with a plain
on_event log of the same events, so the expected values are what happened, not
constants. W&B runs offline (WANDB_MODE=offline) and is read back from its run file;
TensorBoard from its event file; Prometheus by scraping its port; JSONL from the file.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import time
import urllib.request

import pytest

import torch_reccl
from torch_reccl.events import Event, flush_events

from conftest import PRIMARY, EventLog, reccl_env
from wandb_run import finished_run_records, history_rows

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("healed_nics")]


@pytest.fixture(autouse=True)
def quiet_ring():
    """Events left over from earlier tests go out before a sink attaches."""
    flush_events()


@pytest.fixture
def failover_drill(pair_factory):
    """run() fails the primary under a live connection, heals it, and returns the
    reference log of every event of that connection's NIC (after the sinks got them)."""

    def run(heal=True):
        reference = EventLog()
        handle = torch_reccl.on_event(reference)
        try:
            _t, _l, send, recv = pair_factory(reccl_env())
            torch_reccl.inject_fault(PRIMARY, "down")
            moved = reference.wait_for(5, "failover", connection=send.id, count=2)
            assert len(moved) == 2, [e.to_dict() for e in reference.all()]  # both ends
            if heal:
                torch_reccl.inject_fault(PRIMARY, "up")
                assert len(reference.wait_for(5, "failback", connection=send.id, count=2)) == 2
            flush_events()
        finally:
            handle.remove()
        return reference

    return run


def count_of(reference, kind):
    return len(reference.of(kind))


# --------------------------------------------------------------------------- JSONL


def test_jsonl_has_every_event_once(tmp_path, failover_drill):
    from torch_reccl.integrations import jsonl

    path = tmp_path / "events.jsonl"
    with jsonl.attach(str(path), job_wide=False) as attachment:
        reference = failover_drill()
    assert attachment.sink is not None
    logged = [Event.from_dict(json.loads(line)) for line in path.read_text().splitlines()]
    assert logged == reference.all()
    # The receiver's event has no duration when the sender's RESYNC told it of the
    # switch before it saw the loss itself; the sender's always has one.
    assert any(e.kind == "failover" and e.nic == PRIMARY and (e.duration_s or 0) > 0 for e in logged)


def test_jsonl_needs_an_existing_directory(tmp_path):
    from torch_reccl.integrations import jsonl

    with pytest.raises(FileNotFoundError, match="does not exist"):
        jsonl.attach(str(tmp_path / "missing" / "events.jsonl"), job_wide=False)


# --------------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_and_text_read_back(tmp_path, failover_drill):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torch_reccl.integrations import tensorboard

    attachment = tensorboard.attach(log_dir=str(tmp_path), job_wide=False)
    reference = failover_drill()
    attachment.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    scalars = accumulator.Tags()["scalars"]
    failovers = accumulator.Scalars("reccl/failovers")
    assert [s.value for s in failovers] == list(range(1, count_of(reference, "failover") + 1))
    interruptions = [s.value for s in accumulator.Scalars("reccl/interruption_ms")]
    expected = [e.duration_s * 1e3 for e in reference.of("failover")]
    assert interruptions == pytest.approx(expected, rel=1e-6)
    assert accumulator.Scalars("reccl/failbacks")[-1].value == count_of(reference, "failback")
    assert "reccl/nics_down" in scalars
    assert [s.value for s in accumulator.Scalars("reccl/nics_down")][-1] == 0  # healed
    texts = accumulator.Tensors("reccl/events/text_summary")
    assert len(texts) == len(reference.all())
    first_failover = next(t for t in texts if b"failover on " + PRIMARY.encode() in t.tensor_proto.string_val[0])
    assert b"traffic interrupted" in first_failover.tensor_proto.string_val[0]


# --------------------------------------------------------------------------- Prometheus


def scrape(port):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_prometheus_counters_gauges_and_histogram_scraped(failover_drill):
    from torch_reccl.integrations import prometheus

    attachment = prometheus.attach(port=0, addr="127.0.0.1", job_wide=False)
    try:
        port = attachment.sink.port
        reference = failover_drill(heal=False)
        down = scrape(port)
        assert down[("reccl_nic_up", (("nic", PRIMARY),))] == 0
        rank = reference.all()[0].rank
        labels = (("nic", PRIMARY), ("rank", "" if rank is None else str(rank)))
        assert down[("reccl_failovers_total", labels)] == count_of(reference, "failover")
        histogram_count = down[("reccl_interruption_seconds_count", (labels[1],))]
        assert histogram_count == count_of(reference, "failover")
        total = down[("reccl_interruption_seconds_sum", (labels[1],))]
        assert total == pytest.approx(sum(e.duration_s for e in reference.of("failover")))

        torch_reccl.inject_fault(PRIMARY, "up")
        healed = scrape(port)
        assert healed[("reccl_nic_up", (("nic", PRIMARY),))] == 1
        nic_stats = torch_reccl.stats()["nics"][PRIMARY]
        # counters are read at scrape time: nothing moves on an idle connection
        assert healed[("reccl_bytes_sent_total", (("nic", PRIMARY),))] == nic_stats["bytes_sent"]
        assert healed[("reccl_nic_failovers_total", (("nic", PRIMARY),))] == nic_stats["failovers"]
    finally:
        attachment.close()
    with pytest.raises(OSError):
        scrape(port)  # the port is closed again


def test_prometheus_rejects_a_bad_port():
    from torch_reccl.integrations import prometheus

    with pytest.raises(ValueError, match="port"):
        prometheus.attach(port=70000, job_wide=False)


# --------------------------------------------------------------------------- W&B


@pytest.mark.timeout(120)
def test_wandb_offline_run_has_metrics_table_and_one_alert(tmp_path, monkeypatch, failover_drill):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    from torch_reccl.integrations import wandb as reccl_wandb

    run = wandb.init(project="reccl-test")
    try:
        run.log({"loss": 1.0}, step=10)
        attachment = reccl_wandb.attach(job_wide=False, alert_interval_s=300)
        reference = failover_drill()
        run.log({"loss": 0.5}, step=11)  # the user's steps stay the user's
        attachment.close()
        run_dir = os.path.dirname(run.dir)
    finally:
        run.finish()
    records = finished_run_records(run_dir)
    history = history_rows(records)
    assert [row["_step"] for row in history if "loss" in row] == [10, 11], history
    failovers = [row["reccl/failovers"] for row in history if "reccl/failovers" in row]
    assert failovers and failovers[-1] == count_of(reference, "failover")
    assert max(row.get("reccl/step", 0) for row in history) == len(reference.all())
    metrics = [record.metric for record in records if record.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "reccl/*" and m.step_metric == "reccl/step" for m in metrics)
    alerts = [record.alert for record in records if record.WhichOneof("record_type") == "alert"]
    assert len(alerts) == 1, alerts  # two failovers (both ends), one alert
    assert PRIMARY in alerts[0].text and "failover" in alerts[0].text
    rows = []
    for table_file in sorted(glob.glob(os.path.join(run_dir, "files", "media", "table", "reccl", "*.json"))):
        rows += json.load(open(table_file))["data"]
    assert sorted((row[2], row[3]) for row in rows) == sorted((e.kind, e.nic) for e in reference.all())


@pytest.mark.timeout(120)
def test_wandb_waits_for_a_run_made_after_attach(tmp_path, monkeypatch, failover_drill):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    from torch_reccl.integrations import wandb as reccl_wandb

    assert wandb.run is None
    attachment = reccl_wandb.attach(job_wide=False, wait_for_run=True)
    reference = failover_drill()  # events arrive before there is a run: they wait
    run = wandb.init(project="reccl-test")
    try:
        deadline = time.monotonic() + 10
        while attachment.sink.run is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the sink looks for the run once a second
        assert attachment.sink.run is run
        attachment.close()
        run_dir = os.path.dirname(run.dir)
    finally:
        run.finish()
    records = finished_run_records(run_dir)
    steps = [row["reccl/step"] for row in history_rows(records) if "reccl/step" in row]
    assert steps and max(steps) == len(reference.all())


def test_wandb_needs_an_active_run(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    import wandb

    from torch_reccl.integrations import wandb as reccl_wandb

    assert wandb.run is None
    with pytest.raises(RuntimeError, match="wandb.init"):
        reccl_wandb.attach(job_wide=False)


def test_missing_package_names_what_to_install(monkeypatch):
    from torch_reccl.integrations import prometheus, wandb as reccl_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        reccl_wandb.attach(job_wide=False)
    with pytest.raises(ImportError, match="pip install prometheus_client"):
        prometheus.attach(port=0, job_wide=False)


# --------------------------------------------------------------------------- FaultPolicy answers


def policy_answers(loggers) -> list:
    """A lone FaultPolicy through a fault (events and step times fed by hand): healthy,
    failover, k measured, checkpoint_and_exit at step 20; each change goes to loggers."""
    from torch_reccl.events import Event
    from torch_reccl.policy import FaultPolicy

    now = [100.0]
    policy = FaultPolicy(10, t_detect_s=10.0, t_reload_s=0.1, listen=False, loggers=loggers,
                         clock=lambda: now[0])
    answers = []
    for step in range(1, 21):
        if step == 13:
            policy.observe(Event(kind="failover", time=now[0], rank=1, nic="eth0", peer="",
                                 reason="link down", detail="", connection=4))
        seconds = 1.0 if step < 13 else 2.0
        now[0] += seconds
        answers.append(policy.step(step, duration_s=seconds))
    return answers


def test_policy_answers_reach_tensorboard_prometheus_and_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from torch_reccl.integrations import prometheus, tensorboard, wandb as reccl_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(project="reccl-test")
    try:
        sinks = [tensorboard.attach(log_dir=str(tmp_path / "tb"), job_wide=False),
                 prometheus.attach(port=0, addr="127.0.0.1", job_wide=False),
                 reccl_wandb.attach(job_wide=False)]
        answers = policy_answers(sinks)
        assert answers[-1].action == "checkpoint_and_exit" and answers[-1].k == 2.0
        samples = scrape(sinks[1].sink.port)
        for attachment in sinks:
            attachment.close()
        run_dir = os.path.dirname(run.dir)
    finally:
        run.finish()

    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    actions = accumulator.Scalars("reccl/advice/action")
    assert [(s.step, s.value) for s in actions] == [(1, 0), (13, 0), (15, 0), (20, 1)]
    assert accumulator.Scalars("reccl/advice/k")[-1].value == 2.0
    assert accumulator.Scalars("reccl/advice/faults")[-1].value == 1
    texts = accumulator.Tensors("reccl/advice/text_summary")
    assert b"restart at the next checkpoint" in texts[-1].tensor_proto.string_val[0]

    assert samples[("reccl_advice_action", (("reccl_advice_action", "checkpoint_and_exit"),))] == 1
    assert samples[("reccl_advice_action", (("reccl_advice_action", "continue"),))] == 0
    assert samples[("reccl_advice", (("value", "k"),))] == 2.0
    assert samples[("reccl_advice_step", ())] == 20

    # commit=False: the scalars join one row (the latest values); the table has every answer
    history = history_rows(finished_run_records(run_dir))
    advice = [row for row in history if "reccl/advice/action" in row]
    assert advice[-1]["reccl/advice/step"] == 20 and advice[-1]["reccl/advice/action"] == 1
    assert advice[-1]["reccl/advice/k"] == 2.0
    rows = []
    for table_file in sorted(glob.glob(os.path.join(run_dir, "files", "media", "table", "reccl", "*.json"))):
        rows += json.load(open(table_file))["data"]
    assert [row[5] for row in rows if row[2] == "advice"] == [
        "continue", "continue", "continue", "checkpoint_and_exit"]
