"""Transformer models: shared layers and the GPT decoder."""
