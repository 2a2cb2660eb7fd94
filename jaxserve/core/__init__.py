"""The engine's core in plain Python (no jax): requests, sampling params, KV block pool,
prefix cache and the scheduler. Everything here runs on the engine thread."""

from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.config import SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.outputs import (CachedRequestData, EngineCoreOutput, Logprobs, ModelRunnerOutput,
                                   NewRequestData, NoTokenAllowedError, SchedulerOutput)
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import MAX_LOGIT_BIAS, RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.core.scheduler import Scheduler

__all__ = [
    "BlockPool", "CachedRequestData", "EngineCoreOutput", "KVCacheBlock", "KVCacheManager", "Logprobs",
    "MAX_LOGIT_BIAS", "ModelRunnerOutput", "NewRequestData", "NoTokenAllowedError", "Request",
    "RequestOutputKind", "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig", "SchedulerOutput",
    "StructuredOutputsParams",
]
