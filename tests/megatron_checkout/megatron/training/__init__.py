"""Stand-in for Megatron-LM's ``megatron.training`` (tests/megatron_checkout)."""
