"""Stand-in for Megatron-LM's ``megatron.training`` (tests/helpers/megatron_checkout)."""
