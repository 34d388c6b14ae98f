"""Tensor parallelism: how a model splits over ranks (partition.py) and the collectives (parallel_state.py)."""
