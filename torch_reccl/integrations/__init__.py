"""Failover events into the tools people already watch. One module per tool, each with
``attach(...)`` returning an :class:`~torch_reccl.integrations._sink.Attachment`
(``close()`` detaches). The tool's package is imported only when you attach.

- ``torch_reccl.integrations.wandb``        the active W&B run (pip install wandb)
- ``torch_reccl.integrations.tensorboard``  a SummaryWriter (pip install tensorboard)
- ``torch_reccl.integrations.prometheus``   an HTTP /metrics port (pip install prometheus_client)
- ``torch_reccl.integrations.jsonl``        a JSON-lines file (no dependency)

Not an event sink: ``torch_reccl.integrations.torchft`` is torchft's reconfigurable
process group over reccl (``ProcessGroupReccl``; pip install torchft; docs/torchft.md).

By default (``job_wide=None``) a sink sees the whole job when torch.distributed is
initialised: call ``attach`` on every rank; rank 0's sink gets every rank's events
and the others only forward theirs (see torch_reccl.events.on_event).
"""
