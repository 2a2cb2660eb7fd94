"""jaxserve: an LLM serving engine on JAX/XLA.

`SamplingParams` comes from the plain-Python core; `LLM` (which imports jax) is loaded
on first use so that `import jaxserve.core` stays free of jax.
"""

from jaxserve.core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
