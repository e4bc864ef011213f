"""The planner: which devices, layout and batch fit a run and what it costs (plan.py), from its estimates, layouts,
hardware profiles and advice, checked against measured runs."""
