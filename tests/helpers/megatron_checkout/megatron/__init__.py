"""Stand-in for Megatron-LM's ``megatron`` package (tests/helpers/megatron_checkout)."""
