"""Run a command in a process whose fd table starts at the kernel's initial 64
entries, as a rank launched from a shell without high fds open starts (the GPU
machine's Python does; a shell running a script holds fd 255, so its children
start at 256). Linux sizes a forked child's table to the parent's open fds, so
this closes every fd above 2, forks, and execs the command there.

    python bench/fresh_fd_table.py python bench/scale.py --ranks 4 8 ...

Used to reproduce on any machine the fd-table doubling that stalled reccl's
group set-up on the GPU machine (docs/scale.md, sessions 14 and 15).
"""
import os
import sys


def main(argv) -> int:
    if not argv:
        print("usage: python bench/fresh_fd_table.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"fresh_fd_table: cannot run {argv[0]!r}: {e}", file=sys.stderr)
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
