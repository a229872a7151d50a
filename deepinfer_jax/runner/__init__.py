"""The bridge between host and device: persistent step inputs, buckets, and the jitted step."""

from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.model_runner import ChunkSpec, Forward, ModelRunner, PendingStep, SampleSpec, StepInputError
from deepinfer_jax.runner.step_output import SampledToken, StepOutput

__all__ = ["Buckets", "ChunkSpec", "Forward", "ModelRunner", "PendingStep", "SampleSpec", "SampledToken",
           "StepInputError", "StepOutput"]
