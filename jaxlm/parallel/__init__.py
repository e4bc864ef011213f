"""Meshes and placement: the mesh from (data, fsdp, tensor, pipeline) sizes and the one table of logical-axis rules
(sharding.py), and multi-process start-up (distributed.py)."""
