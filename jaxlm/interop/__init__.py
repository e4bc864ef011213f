"""Other tools' formats: HF weights and config (hf_weights.py, hf_config.py), streaming a large base in and a merged
model out (streaming.py), PEFT adapter folders (peft_folders.py), and lm-eval's model (lm_eval_model.py)."""
