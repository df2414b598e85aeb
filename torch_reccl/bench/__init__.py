"""The benchmarks' code: ``reccl bench`` and what bench/'s scripts share with the tests.

- cli: ``reccl bench``, busbw of the "reccl" backend against Gloo, or of NCCL with
  the plugin (variants, the table); rank: the program each of its ranks runs.
- procstat: what /proc says of a process's threads and fds, the one reader of the
  benchmarks (bench/) and the tests.
- scaling: bench/scale.py's measurement.
- The runs in the emulated fabric, each a program its driver starts per host
  (``python -m torch_reccl.bench.<module>``): fabric_train and outage_train (a small
  training job), nccl_net (the NCCL net plugin driven as NCCL's proxy drives it) and
  spread_peer (spreading through the plugin or the transport); grey_fabric (the
  grey-failure job and its driver).
- advisor_drill and megatron_fault: the runners behind bench/advisor_drill.py and
  bench/megatron_fault.py.
- torchft_compare (with torchft_replica, its replicas and agents): Gloo against
  reccl under torchft, for bench/torchft_fault.py and tests/pg/test_torchft.py.

rank and procstat import nothing of torch_reccl, so bench/ loads them by path where
the package must stay unimported (bench/fresh_fd_table.py, bench/thread_cpu.py).
"""
