"""Stands in for Megatron-LM's megatron/training/training.py at the points the
launcher hooks (written from its public source): ``train()`` runs iterations while
``iteration < train_iters``, calling this module's ``train_step`` by its global
name with ``iteration=`` the iterations done, then counts the iteration and, on the
last rank, logs it as Megatron's training_log does (``iteration N/ M | lm loss:
X |``, the loss as ``{:.6E}``). With an exit-signal handler every rank stops at the
iteration where any rank got SIGTERM, as Megatron's does, after saving a checkpoint
when ``save`` is given (Megatron's ``save_checkpoint_and_time`` with ``--save``),
which it also does every ``save_interval`` iterations.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def batch(iteration: int, rank: int):
    """This rank's batch: the same in every run."""
    return torch.randn(32, 256, generator=torch.Generator().manual_seed(iteration * 1009 + rank))


def train_step(model, optimizer, data, iteration=None):
    loss = model(data).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    averaged = loss.detach().clone()
    dist.all_reduce(averaged)
    return {"lm loss": averaged / dist.get_world_size()}


def train(model, optimizer, train_iters: int, signal_handler=None, on_iteration=None,
          iteration: int = 0, save=None, save_interval: int = 0):
    rank, world = dist.get_rank(), dist.get_world_size()
    while iteration < train_iters:
        if on_iteration is not None:
            on_iteration(iteration)
        loss_dict = train_step(model, optimizer, batch(iteration, rank), iteration=iteration)
        iteration += 1
        if rank == world - 1:
            print(f" iteration {iteration:8d}/{train_iters:8d} | lm loss: {loss_dict['lm loss'].item():.6E} |",
                  flush=True)
        if save is not None and save_interval and iteration % save_interval == 0:
            save(iteration)
        if signal_handler is not None and any(signal_handler.signals_received()):
            if save is not None:
                save(iteration)
            print(f"rank {rank}: exit signal at step {iteration - 1}", flush=True)
            break
    return iteration
