"""The training core: the train state and the pure steps (steps.py), THE loop (loop.py), the optimizer (optim.py),
float16 loss scaling, pipeline gradients, checkpoints, stop signals and non-finite steps, telemetry, metrics and the
run report."""
