"""Hugging Face checkpoints for research code, the stable entry points: `from_pretrained(folder)` builds a jaxlm
model from an HF folder, `save_pretrained(model, folder)` writes one that transformers loads. Their implementation
and the weight tables are jaxlm/interop/hf_weights.py."""

from jaxlm.interop.hf_weights import from_pretrained, save_pretrained  # noqa: F401  (the public API)
