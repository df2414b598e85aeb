"""bench/scale.py's measurement: what groups, rendezvous and an idle job cost, reccl
against Gloo (bench/scale.py's docstring and docs/scale.md say what each number is).

The modules, by what they measure, around one runner:

    runner.py    the ranks (forked by a zygote, or spawned), the phases, run_job
    store.py     store requests: the counting proxy and TCPStore's wire format
    groups.py    init, group creation and first use
    idle.py      the idle window: CPU, wake-ups, threads, fds, store requests
    latency.py   the 4-byte all_reduce
    busbw.py     busbw: the plan, each rank's checked and timed loop
    report.py    the tables
    ceiling.py   the loopback ring ceiling (also bench/wire_ceiling.py's)

bench/scale.py is the command line; the rank processes run runner.py
(``python -m torch_reccl.bench.scaling.runner``), so every rank imports torch_reccl;
that loads no extension and starts no thread, so a Gloo rank runs on Gloo alone.
"""
