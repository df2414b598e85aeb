"""``reccl bench``: busbw of the "reccl" backend against Gloo, or of NCCL with the plugin.

cli: the command (variants, the table); rank: the program each rank runs.
"""
