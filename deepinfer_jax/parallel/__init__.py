"""Parallelism pieces beyond one device: expert load balancing (host, numpy) and the expert-parallel MoE (device).

``eplb`` and ``eplb_policy`` are host code (no jax); ``ep_moe``, ``weight_moves`` and ``mesh`` are device code.
Import the submodules directly; nothing is re-exported here so that host users never import jax.
"""
