"""Engine integrations through official extension points: the vLLM plugin and the Megatron-core layer spec."""
