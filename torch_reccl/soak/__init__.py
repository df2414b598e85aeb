"""``reccl soak``: a long randomized fault campaign against a checked job.

schedule: the seeded fault schedule; worker: one rank's job; runner: the driver
that applies faults, samples resources and judges the run; cli: the command;
plot: its PNG.
"""
