"""Scripts that tests run in subprocesses with fake CPU devices (XLA_FLAGS) or as several jax.distributed processes."""
