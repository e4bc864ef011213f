"""Transformer models: shared layers (layers.py), the GPT decoder in gpt2 and llama flavours (gpt.py), BERT
(bert.py)."""
