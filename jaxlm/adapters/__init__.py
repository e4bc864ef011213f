"""Low-rank adapters: LoRA and QLoRA as a trainable/frozen split of the parameters (lora.py), the NF4 base (nf4.py)."""
