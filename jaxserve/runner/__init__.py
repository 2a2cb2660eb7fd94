"""The device side of a step: input preparation, the jitted step, on-device sampling."""

from jaxserve.runner.inputs import RequestState, StepInputs, prepare_inputs, token_buckets
from jaxserve.runner.model_runner import ModelRunner, step_fn

__all__ = ["ModelRunner", "RequestState", "StepInputs", "prepare_inputs", "step_fn", "token_buckets"]
