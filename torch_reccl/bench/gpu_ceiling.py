"""The GPU network path's ceiling for bench/nccl_busbw.py: how fast two ranks on this
machine move a collective's bytes GPU -> host -> TCP -> host -> GPU with plain
sockets and no collective library.

With two ranks each rank sends, and receives, exactly its busbw in bytes (nccl-tests'
conventions): the tensor's size for all_reduce and all_gather, half of it for
reduce_scatter. Here each rank moves those bytes to the other at once, both ways:
the source is split into CHUNK pieces dealt round-robin over `socks_per_nic` sockets
on each NIC; per socket a sender thread copies a piece into a pinned buffer and
writes it, a receiver thread reads a piece into a pinned buffer and copies it into
the destination on the GPU. Each thread copies on its own CUDA stream into two
buffers in turn, so a piece's GPU copy overlaps the previous piece's socket I/O and
the copies of all sockets overlap. A library that moves the same bytes with the same
copies cannot beat this by much; the reductions come on top.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import List

CHUNK = 4 << 20
CONNECT_TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the peer closed a ceiling socket early")
        got += n


def _connect(rank: int, nics: List[str], socks_per_nic: int, store) -> List[socket.socket]:
    """Rank 0 listens on every NIC, rank 1 dials each `socks_per_nic` times; the ports
    travel through the store."""
    socks = []
    if rank == 0:
        listeners = []
        for i, addr in enumerate(nics):
            listener = socket.create_server((addr, 0))
            listener.settimeout(CONNECT_TIMEOUT_S)
            listeners.append(listener)
            store.set(f"ceiling/port/{i}", str(listener.getsockname()[1]))
        for listener in listeners:
            for _ in range(socks_per_nic):
                conn, _ = listener.accept()
                socks.append(conn)
            listener.close()
    else:
        for i, addr in enumerate(nics):
            port = int(store.get(f"ceiling/port/{i}"))
            for _ in range(socks_per_nic):
                socks.append(socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S))
    for sock in socks:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def _move(socks, src, dst, buffers, streams, torch) -> None:
    """Sends all of `src` to the peer and receives the peer's into `dst`, both at once.
    Each thread double-buffers: the GPU copy of one piece overlaps the socket I/O of
    the other."""
    pieces = [(start, min(CHUNK, src.numel() - start)) for start in range(0, src.numel(), CHUNK)]
    errors = []

    def sender(index):
        try:
            sock, hosts, stream = socks[index], buffers[index][0], streams[index][0]
            mine = pieces[index::len(socks)]
            copied = [torch.cuda.Event(), torch.cuda.Event()]
            with torch.cuda.stream(stream):
                if mine:
                    start, size = mine[0]
                    hosts[0][:size].copy_(src[start:start + size], non_blocking=True)
                    copied[0].record(stream)
                for k, (start, size) in enumerate(mine):
                    if k + 1 < len(mine):  # the next piece's copy runs while this one is written
                        nstart, nsize = mine[k + 1]
                        hosts[(k + 1) % 2][:nsize].copy_(src[nstart:nstart + nsize], non_blocking=True)
                        copied[(k + 1) % 2].record(stream)
                    copied[k % 2].synchronize()
                    sock.sendall(memoryview(hosts[k % 2].numpy())[:size])
        except BaseException as error:  # reported by the caller
            errors.append(error)

    def receiver(index):
        try:
            sock, hosts, stream = socks[index], buffers[index][1], streams[index][1]
            copied = [torch.cuda.Event(), torch.cuda.Event()]
            with torch.cuda.stream(stream):
                for k, (start, size) in enumerate(pieces[index::len(socks)]):
                    if k >= 2:
                        copied[k % 2].synchronize()  # this buffer's previous copy has left it
                    _recv_exact(sock, memoryview(hosts[k % 2].numpy())[:size])
                    dst[start:start + size].copy_(hosts[k % 2][:size], non_blocking=True)
                    copied[k % 2].record(stream)
                stream.synchronize()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(len(socks)) for fn in (sender, receiver)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CONNECT_TIMEOUT_S * 4)
    if errors or any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"ceiling transfer failed: {errors or 'a thread did not finish in time'}")


def ceiling_busbw(rank: int, nics: List[str], socks_per_nic: int, store, ops, sizes_mib, iters: int) -> dict:
    """{"op/MiB": GB/s} as bench/nccl_busbw.py reports busbw, for moving each op's
    per-rank bytes with plain sockets and the same GPU<->host copies."""
    import torch

    socks = _connect(rank, nics, socks_per_nic, store)
    try:
        buffers = [tuple([torch.empty(CHUNK, dtype=torch.uint8).pin_memory() for _ in range(2)]
                         for _ in range(2)) for _ in socks]  # (send pair, receive pair)
        streams = [(torch.cuda.Stream(), torch.cuda.Stream()) for _ in socks]
        results = {}
        for name in ops:
            for mib in sizes_mib:
                nbytes = (mib << 20) // (2 if name == "reduce_scatter" else 1)
                src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                _move(socks, src, dst, buffers, streams, torch)  # warm-up
                store.add(f"ceiling/ready/{name}/{mib}", 1)  # both ranks start together
                deadline = time.monotonic() + CONNECT_TIMEOUT_S
                while int(store.add(f"ceiling/ready/{name}/{mib}", 0)) < 2:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the other ceiling rank did not get ready in time")
                    time.sleep(0.001)
                start = time.perf_counter()
                for _ in range(iters):
                    _move(socks, src, dst, buffers, streams, torch)
                seconds = (time.perf_counter() - start) / iters
                if not bool((dst == 1).all()):
                    raise RuntimeError(f"ceiling transfer of {name}/{mib} delivered wrong bytes")
                results[f"{name}/{mib}"] = nbytes / seconds / 1e9
        return results
    finally:
        for sock in socks:
            sock.close()
