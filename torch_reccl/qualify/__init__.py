"""``reccl qualify``: does reccl see, reach, outrun and survive this cluster's NICs?

Run on the real hosts by torchrun (one process per GPU, or one per host for CPU jobs)::

    torchrun --nnodes N --nproc-per-node G -m torch_reccl.qualify --json q.json --report q.md

or ``reccl qualify --local 2`` to try it on one machine. Four checks, in order
(torch_reccl.qualify.steps): inventory, reachability, performance, failover. See
docs/first_cluster.md.

job: the ranks and the store; inventory, reach, collectives: the checks' own code;
steps: each check as every rank runs it; gpu_worker: a GPU variant's process;
rank: one rank's run; local: ``--local N``; report: summary, JSON and Markdown;
cli: the command line.
"""
