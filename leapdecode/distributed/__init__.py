"""Running one model over several processes: the tensor-parallel group (parallel_state.py)."""
