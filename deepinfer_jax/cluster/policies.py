"""The router's policies in one namespace (issue 23 item 3), shared by a live router and the simulator.

Each lives in its own module: ``prefix_index`` (prefix match at the entry), ``prefill_balancer``
(length buckets, DP group, rank; the in-rank chunking is ``engine.cost_model``),
``decode_balancer`` (``engine.dp_router.pick_rank`` over all decode ranks), ``decode_rebalance``
(migrations after placement), ``vision_balancer``
and ``autoscaler``. All are pure functions or small dataclasses over the caller's view of the
instances; bad input raises ``PolicyInputError`` (a ``ValueError``) naming the field.
"""

from deepinfer_jax.cluster.autoscaler import (
                                              Autoscaler,
                                              AutoscalerSettings,
                                              ClusterSignals,
                                              RoleSettings,
                                              RoleState,
                                              ScaleDecision,
                                              count_oscillations,
                                              decide,
                                              desired_instances,
)
from deepinfer_jax.cluster.decode_balancer import DecodeInstanceView, RankLoad, pick_decode_rank
from deepinfer_jax.cluster.decode_rebalance import Move, RebalanceSettings, migration_pause_s, plan_moves
from deepinfer_jax.cluster.errors import PolicyInputError
from deepinfer_jax.cluster.prefill_balancer import (
                                              BUCKET_EDGES,
                                              PrefillBalancer,
                                              PrefillEngineView,
                                              SlotRule,
                                              length_bucket,
                                              matched_step_budget,
                                              pick_prefill_group,
                                              pick_prefill_rank,
                                              pick_prefill_slot,
                                              reassign_engines,
                                              request_quota,
                                              resize_buckets,
                                              route_prefill,
)
from deepinfer_jax.cluster.prefix_index import PrefixIndex, PrefixMatch, match_digests, match_tokens
from deepinfer_jax.cluster.vision_balancer import num_patches, pick_vision_card

__all__ = ["BUCKET_EDGES", "Autoscaler", "AutoscalerSettings", "ClusterSignals", "DecodeInstanceView", "Move",
           "PolicyInputError", "PrefillBalancer", "PrefillEngineView", "PrefixIndex", "PrefixMatch", "RankLoad",
           "RebalanceSettings", "RoleSettings", "RoleState", "ScaleDecision", "SlotRule", "count_oscillations",
           "decide", "desired_instances", "length_bucket", "match_digests", "match_tokens", "matched_step_budget",
           "migration_pause_s", "num_patches", "pick_decode_rank", "pick_prefill_group", "pick_prefill_rank",
           "pick_prefill_slot", "pick_vision_card", "plan_moves", "reassign_engines", "request_quota",
           "resize_buckets", "route_prefill"]
