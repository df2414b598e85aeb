"""Events and NIC counters as Prometheus metrics on an HTTP port you opt into::

    torch_reccl.integrations.prometheus.attach(port=9400)   # scrape http://host:9400/metrics

From events (labels ``rank``, ``nic``; job-wide on rank 0):

- ``reccl_failovers_total``, ``reccl_failbacks_total``  counters
- ``reccl_events_total{kind=...}``                     every event, by kind
- ``reccl_interruption_seconds``                       histogram of failover interruptions
- ``reccl_slowdown``                                   gauge: the last measured slowdown

From a :class:`~torch_reccl.policy.FaultPolicy` given ``loggers=``:
``reccl_advice_action`` (an enum: continue, checkpoint_and_exit, exit_now),
``reccl_advice{value=faults|k|t_elapsed_s|threshold_s|t_restart_s|t_failover_s}``
and ``reccl_advice_step``.

From this process's ``torch_reccl.stats()``, read at scrape time (label ``nic``):
``reccl_nic_up`` (1 usable, 0 not), ``reccl_bytes_sent_total``,
``reccl_bytes_received_total``, ``reccl_nic_failovers_total``,
``reccl_events_dropped_total``, ``reccl_stalled_connections`` (connections with no
usable path now, waiting for one: an outage) and ``reccl_stalls_total``. Each process
serves its own NIC counters, so give each rank that should be scraped its own port.
Needs ``pip install prometheus_client``.
"""
from __future__ import annotations

from typing import Iterable, Optional

from torch_reccl.events import Event
from torch_reccl.integrations._sink import (
    ADVICE_ACTIONS,
    Attachment,
    advice_scalars,
    attach_sink,
    require,
)

# Interruptions (s): failovers take ms on a dead link, up to a heartbeat on a silent one.
INTERRUPTION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _NicStatsCollector:
    """Reads torch_reccl.stats() at scrape time, so the numbers are never stale."""

    def __init__(self, metrics_module):
        self._m = metrics_module

    def collect(self):
        from torch_reccl._native import stats

        core = self._m
        snapshot = stats()
        up = core.GaugeMetricFamily("reccl_nic_up", "1 when the NIC is usable, 0 when down", labels=["nic"])
        sent = core.CounterMetricFamily("reccl_bytes_sent", "bytes sent on the NIC", labels=["nic"])
        received = core.CounterMetricFamily("reccl_bytes_received", "bytes received on the NIC", labels=["nic"])
        moved = core.CounterMetricFamily("reccl_nic_failovers", "failovers away from a path on the NIC",
                                         labels=["nic"])
        for name, nic in sorted(snapshot["nics"].items()):
            up.add_metric([name], 1.0 if nic["up"] else 0.0)
            sent.add_metric([name], nic["bytes_sent"])
            received.add_metric([name], nic["bytes_received"])
            moved.add_metric([name], nic["failovers"])
        dropped = core.CounterMetricFamily("reccl_events_dropped", "events lost to a full event ring")
        dropped.add_metric([], snapshot.get("events_dropped", 0))
        stalled = core.GaugeMetricFamily("reccl_stalled_connections",
                                         "connections with no usable path now, waiting for one")
        stalled.add_metric([], len(snapshot.get("stalled", [])))
        stalls = core.CounterMetricFamily("reccl_stalls", "stalls reported (stalled events that began one)")
        stalls.add_metric([], snapshot.get("stalls", 0))
        return [up, sent, received, moved, dropped, stalled, stalls]


class PrometheusSink:
    def __init__(self, port: int, addr: str, registry=None):
        client = require("prometheus_client", "prometheus_client", "prometheus")
        core = require("prometheus_client.core", "prometheus_client", "prometheus")
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"port={port!r} is not valid: expected 0..65535 (0: any free port)")
        self.registry = registry if registry is not None else client.CollectorRegistry()
        labels = ["rank", "nic"]
        self.failovers = client.Counter("reccl_failovers", "failovers (one per connection end that moved)",
                                        labels, registry=self.registry)
        self.failbacks = client.Counter("reccl_failbacks", "failbacks onto a healed primary",
                                        labels, registry=self.registry)
        self.events = client.Counter("reccl_events", "events by kind", ["rank", "kind"],
                                     registry=self.registry)
        self.interruption = client.Histogram(
            "reccl_interruption_seconds", "failover: fault detected -> traffic resumed",
            ["rank"], buckets=INTERRUPTION_BUCKETS, registry=self.registry)
        self.slowdown = client.Gauge("reccl_slowdown", "last measured slowdown after a failover "
                                     "(throughput before / after)", ["rank", "nic"], registry=self.registry)
        self.advice_action = client.Enum("reccl_advice_action", "the FaultPolicy's latest answer",
                                         states=list(ADVICE_ACTIONS), registry=self.registry)
        self.advice_values = client.Gauge(
            "reccl_advice", "the FaultPolicy's latest inputs: faults, k, and the rule's times (s)",
            ["value"], registry=self.registry)
        self.advice_step = client.Gauge("reccl_advice_step", "training step of the latest answer",
                                        registry=self.registry)
        self._stats_collector = _NicStatsCollector(core)
        self.registry.register(self._stats_collector)
        self._server, self._thread = client.start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port

    def handle(self, event: Event) -> None:
        rank = "" if event.rank is None else str(event.rank)
        self.events.labels(rank, event.kind).inc()
        if event.kind == "failover":
            self.failovers.labels(rank, event.nic).inc()
            if event.duration_s is not None:
                self.interruption.labels(rank).observe(event.duration_s)
        elif event.kind == "failback":
            self.failbacks.labels(rank, event.nic).inc()
        elif event.kind == "slowdown" and event.slowdown is not None:
            self.slowdown.labels(rank, event.nic).set(event.slowdown)

    def advice(self, record: dict) -> None:
        """A FaultPolicy answer: ``reccl_advice_action``, ``reccl_advice{value=...}``."""
        self.advice_action.state(record["action"])
        self.advice_step.set(record["step"])
        for name, value in advice_scalars(record).items():
            if name != "advice/action":
                self.advice_values.labels(name.split("/", 1)[1]).set(value)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self.registry.unregister(self._stats_collector)


def attach(port: int = 9400, addr: str = "0.0.0.0", kinds: Optional[Iterable[str]] = None,
           job_wide: Optional[bool] = None, store=None, registry=None) -> Attachment:
    """Serves /metrics on ``addr:port`` (port 0: a free one, see ``.sink.port``).

    ``registry``: a prometheus_client CollectorRegistry to add to (default: a new one,
    served alone on this port).
    """
    return attach_sink(lambda: PrometheusSink(port, addr, registry), kinds, job_wide, store)
