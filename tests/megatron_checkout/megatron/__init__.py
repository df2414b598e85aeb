"""Stand-in for Megatron-LM's ``megatron`` package (tests/megatron_checkout)."""
