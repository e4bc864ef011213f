"""Generation with a KV cache (generate.py)."""
