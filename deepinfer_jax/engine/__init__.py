"""HOST: requests, sampling settings, the scheduler (cost model), the core loop, outputs."""

from deepinfer_jax.engine.core import EngineCore, EngineStats
from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer_jax.engine.request import Request, Status
from deepinfer_jax.engine.sampling_params import RequestError, SamplingParams
from deepinfer_jax.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput

__all__ = ["CompletionOutput", "CostModel", "EngineCore", "EngineStats", "Request", "RequestError", "RequestMetrics",
           "RequestOutput", "SamplingParams", "ScheduledChunk", "Scheduler", "SchedulerOutput", "Status",
           "TokenLogprobs"]
