"""Across engines (engine.md §3, docs/cluster.md): the router's policies and a production-scale simulator.

``policies``: prefix match at the entry, the prefill balancer (four layers), the decode balancer,
the vision-encoder balancer and the autoscaler, as pure functions a live router calls with its view
of the instances. ``simulate``: a discrete-event simulator that judges them against baselines.
Pure Python (numpy only in the traces); the live cluster (roles, Ray, forwarding) builds on these.
"""

from deepinfer_jax.cluster.policies import *
from deepinfer_jax.cluster.policies import __all__  # noqa: F401
