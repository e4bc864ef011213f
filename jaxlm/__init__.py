"""jaxlm: a JAX/Flax research framework for transformer language models."""
