"""Run a process inside a named network namespace, without the ``ip`` command.

This does what ``ip netns exec NAME CMD`` does, with plain system calls
(through ctypes, so it works on Python < 3.12 that lacks ``os.setns``):

1. ``setns(fd, CLONE_NEWNET)`` into the namespace bound at ``/run/netns/NAME``;
2. ``unshare(CLONE_NEWNS)`` and remount ``/sys`` so that ``/sys/class/net``
   shows the namespace's interfaces (sysfs shows the network namespace of
   whoever mounted it). As with ``ip netns exec``, the mounts that were under
   ``/sys`` (``/sys/fs/cgroup``...) are not visible to the child.

Both steps run in the forked child (``preexec_fn``), the caller's process and
its other threads never change namespace.

Also usable as a script (it does not import the ``torch_reccl`` package)::

    python nsexec.py NETNS CMD [ARGS...]
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

NETNS_RUN_DIR = "/run/netns"

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 0x2

_libc = None


def _get_libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        # resolve every symbol now: the child of a fork should not have to
        for fn in ("setns", "unshare", "mount", "umount2"):
            getattr(_libc, fn)
    return _libc


def netns_path(name: str) -> str:
    """Path of the bind mount that names network namespace ``name``."""
    if "/" in name:
        return name
    return os.path.join(NETNS_RUN_DIR, name)


def open_netns(name: str) -> int:
    """Open the namespace ``name``; returns an fd (caller closes it).

    Raises FileNotFoundError with the namespace's name when it does not exist.
    """
    path = netns_path(name)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"network namespace {name!r} does not exist (no {path})"
        ) from None


def _sys_readonly() -> bool:
    try:
        return bool(os.statvfs("/sys").f_flag & os.ST_RDONLY)
    except OSError:
        return False


def make_preexec(ns_fd: int, ns_name: str, remount_sys: bool = True, then=None):
    """Return a ``preexec_fn`` that moves the child into the namespace.

    ``ns_fd`` must stay open in the parent until ``Popen`` returns.
    ``then`` is an optional further preexec_fn (the caller's own).
    """
    libc = _get_libc()
    sysfs_src = ns_name.encode()
    sysfs_flags = MS_RDONLY if _sys_readonly() else 0

    def _preexec():
        if libc.setns(ns_fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns_name!r} failed: "
                               f"{os.strerror(err)}")
        if remount_sys and libc.unshare(CLONE_NEWNS) == 0:
            # best effort, exactly like `ip netns exec`: private view of /sys
            if libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) == 0:
                libc.umount2(b"/sys", MNT_DETACH)
                libc.mount(sysfs_src, b"/sys", b"sysfs", sysfs_flags, None)
        if then is not None:
            then()

    return _preexec


def write_file_in(name: str, path: str, value: str, timeout_s: float = 5.0) -> None:
    """Write ``value`` to ``path`` as seen from network namespace ``name``: a
    ``/proc/sys/net/...`` setting of that namespace. A short-lived thread joins
    the namespace (setns moves only the calling thread) and writes; the caller's
    threads stay where they are. Raises OSError naming the namespace."""
    libc = _get_libc()
    fd = open_netns(name)
    failure = []

    def write():  # owns fd: a late thread must not setns through a reused number
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into network namespace {name!r} failed: {os.strerror(err)}")
            with open(path, "w") as f:
                f.write(value)
        except OSError as e:
            failure.append(e)
        finally:
            os.close(fd)

    worker = threading.Thread(target=write, name=f"netns-{name}", daemon=True)
    try:
        worker.start()
    except BaseException:
        os.close(fd)
        raise
    worker.join(timeout_s)
    if worker.is_alive():
        raise OSError(f"writing {path} in network namespace {name!r} took over {timeout_s:g} s")
    if failure:
        raise OSError(failure[0].errno, f"writing {value!r} to {path} in network namespace {name!r} "
                                        f"failed: {failure[0].strerror or failure[0]}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: nsexec.py NETNS CMD [ARGS...]", file=sys.stderr)
        return 2
    name, cmd = argv[0], argv[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        fd = open_netns(name)
    except FileNotFoundError as e:
        print(f"nsexec: {e}", file=sys.stderr)
        return 1
    make_preexec(fd, name)()
    os.close(fd)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"nsexec: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
