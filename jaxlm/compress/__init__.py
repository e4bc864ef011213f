"""Post-training compression: int8 weights (int8.py) and quantization (quantization.py), calibration, SmoothQuant,
pruning, distillation and their checkpoint files."""
