"""Kinds of run, each a task for the one loop: pretraining, classifier fine-tuning, instruction tuning; where
fine-tuning starts (init_from.py), defaults that fit the data, and reading a trained run back (trained_runs.py)."""
