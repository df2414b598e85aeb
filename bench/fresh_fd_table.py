"""Run a command in a process whose fd table starts at the kernel's initial 64
entries, as a rank launched from a shell without high fds open starts (the GPU
machine's Python does; the dev VM's shell passes fds 250 and 255 down, so its
children start at 256). Linux sizes a forked child's table to the parent's open
fds, so this closes every fd above 2, forks, and execs the command there.

    python bench/fresh_fd_table.py [--json PATH] -- python bench/scale.py --ranks 4 8 ...

Used to reproduce on any machine the fd-table doubling that stalled reccl's
group set-up on the GPU machine (docs/scale.md, sessions 14 and 15). The exit
code is the command's; --json records the command, the table size it started
with, its exit code and wall time.
"""
import argparse
import datetime
import json
import os
import sys
import time


def _fd_table_entries() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("FDSize:"):
                return int(line.split()[1])
    return -1


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the command, its starting fd table size, exit code and wall time here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: expected e.g. `-- python bench/scale.py --ranks 4`")
    out = open(args.json, "w") if args.json else None  # opened before the fds above 2 are closed
    keep = [out.fileno()] if out else []
    os.closerange(3, min(keep) if keep else os.sysconf("SC_OPEN_MAX"))
    if keep:
        os.closerange(max(keep) + 1, os.sysconf("SC_OPEN_MAX"))
    report_read, report_write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(report_read)
        if out:
            os.close(out.fileno())  # the child's table then holds fds 0-2 and the pipe only
        os.write(report_write, str(_fd_table_entries()).encode())
        os.close(report_write)
        try:
            os.execvp(command[0], command)
        except OSError as e:
            print(f"fresh_fd_table: cannot run {command[0]!r}: {e}", file=sys.stderr)
            os._exit(127)
    os.close(report_write)
    with os.fdopen(report_read) as report:
        started_with = int(report.read() or -1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if out:
        json.dump({"command": command, "fd_table_at_start": started_with, "exit_code": code,
                   "wall_s": time.monotonic() - start,
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                  out, indent=1)
        out.close()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
