"""Across engines (engine.md §3, docs/cluster.md): the router's policies and a production-scale simulator.

``policies``: prefix match at the entry, the prefill balancer (four layers), the decode balancer,
the vision-encoder balancer and the autoscaler, as pure functions a live router calls with its view
of the instances. ``simulate``: a discrete-event simulator that judges them against baselines.
Pure Python (numpy only in the traces). The live cluster builds on these: ``handoff`` (the format
between engines), ``roles`` (prefill / decode instances around an ``LLM``), ``actors`` and ``live``
(``Cluster``: the instances as Ray actors, the router on the driver; imported on first use, Ray is
an optional extra), ``streaming`` (its per-token deltas) and ``scaling`` (the autoscaler, live).
"""

from deepinfer_jax.cluster.policies import *
from deepinfer_jax.cluster.policies import __all__  # noqa: F401


def __getattr__(name):
    if name == "Cluster":  # needs Ray: imported only when asked for
        from deepinfer_jax.cluster.live import Cluster

        return Cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
