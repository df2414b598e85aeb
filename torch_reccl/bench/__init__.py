"""The benchmarks' code: ``reccl bench`` and what bench/'s scripts share with the tests.

cli: ``reccl bench``, busbw of the "reccl" backend against Gloo, or of NCCL with the
plugin (variants, the table); rank: the program each of its ranks runs; procstat:
what /proc says of a process's threads and fds, the one reader of the benchmarks
(bench/) and the tests; scaling: bench/scale.py's measurement. rank and procstat
import nothing of torch_reccl, so bench/ loads them by path where the package must
stay unimported (bench/fresh_fd_table.py, bench/thread_cpu.py).
"""
