"""``reccl bench``: busbw of the "reccl" backend against Gloo, or of NCCL with the plugin.

cli: the command (variants, the table); rank: the program each rank runs; procstat:
what /proc says of a process's threads and fds, the one reader of the benchmarks
(bench/) and the tests. rank and procstat import nothing of torch_reccl, so bench/
loads them by path where the package must stay unimported (a Gloo rank).
"""
