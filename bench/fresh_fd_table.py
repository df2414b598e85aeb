"""Run a command in a process whose fd table starts at the kernel's initial 64
entries, as a rank launched from a shell without high fds open starts (the GPU
machine's Python does; the dev VM's shell passes fds 250 and 255 down, so its
children start at 256). Linux sizes a forked child's table to the parent's open
fds, so this closes every fd above 2, forks, and execs the command there.

    python bench/fresh_fd_table.py [--json PATH] -- python bench/scale.py --ranks 4 8 ...

Used to reproduce on any machine the fd-table doubling that stalled reccl's
group set-up on the GPU machine (docs/scale.md, "Set-up"). The exit
code is the command's; --json records the command, the table size it started
with, its exit code and wall time.
"""
import argparse
import datetime
import os
import sys
import time

from reccl_bench_runs import load_standalone, write_json  # beside this file

procstat = load_standalone("bench.procstat")


def main(argv) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the command, its starting fd table size, exit code and wall time here")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: expected e.g. `-- python bench/scale.py --ranks 4`")
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    report_read, report_write = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child never returns into main: it execs or exits
        try:
            os.close(report_read)
            os.write(report_write, str(procstat.fd_table_entries()).encode())
            os.close(report_write)
            os.execvp(command[0], command)
        except Exception as e:
            print(f"fresh_fd_table: cannot run {command[0]!r}: {e}", file=sys.stderr)
        os._exit(127)
    os.close(report_write)
    with os.fdopen(report_read) as report:
        started_with = int(report.read() or -1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    write_json(args.json, {"command": command, "fd_table_at_start": started_with, "exit_code": code,
                           "wall_s": time.monotonic() - start,
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
