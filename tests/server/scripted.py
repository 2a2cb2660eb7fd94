"""An LLMEngine stand-in whose outputs can be worked out by hand, for the streaming layer.

It keeps the real OutputProcessor (detokenization, stop strings, n > 1, output kinds)
and the real tiny tokenizer, and replaces scheduler + model with a script: completion i
of a request generates `script(prompt_ids, i)` one token per step and then finishes
with "length". The real AsyncEngine and server run on top of it, in milliseconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jaxserve.core import EngineCoreOutput, Logprobs, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.output_processor import OutputProcessor


@dataclasses.dataclass
class _Core:
    tokens: list[int]
    logprobs: bool
    done: int = 0


class ScriptedEngine:
    def __init__(self, tokenizer, script: Callable[[list[int], int], list[int]], *, max_model_len: int = 128,
                 vocab_size: int = 1000, max_logprobs: int = 20, step_delay_s: float = 0.0,
                 fail_at_step: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.model_name = "scripted"
        self.max_model_len = max_model_len
        self.config = dataclasses.make_dataclass("C", [("max_logprobs", int)])(max_logprobs)
        self.model_config = dataclasses.make_dataclass("M", [("vocab_size", int)])(vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.step_delay_s = step_delay_s
        self.fail_at_step = fail_at_step
        self.num_steps = 0
        self._cores: dict[str, _Core] = {}
        self.added: list[str] = []       # request ids, in order
        self.aborted: list[str] = []     # those aborted before they finished

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, **_) -> int:
        params = params or SamplingParams()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else list(prompt)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not ids:   # LLMEngine.add_request's checks of the prompt, which the server relies on
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        core_ids = [f"{i}_{request_id}" for i in range(params.n)]
        for i, core_id in enumerate(core_ids):
            self._cores[core_id] = _Core(self.script(ids, i)[:params.max_tokens], params.logprobs is not None)
        self.output_processor.add(request_id, prompt.get("prompt") if isinstance(prompt, dict) else None, ids,
                                  params, core_ids, time.monotonic())
        self.added.append(request_id)
        return len(ids)

    def step(self):
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("injected step failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs = []
        for core_id, core in list(self._cores.items()):
            token = core.tokens[core.done]
            core.done += 1
            finished = core.done == len(core.tokens)
            # Logprobs worked out by hand too: the token's own is -(its id), its one alternative id 0.
            lps = [Logprobs(-float(token), [0], [-0.5])] if core.logprobs else []
            outs.append(EngineCoreOutput(core_id, [token], lps, finish_reason="length" if finished else None))
            if finished:
                del self._cores[core_id]
        outputs, stopped, failed = self.output_processor.process(outs, time.monotonic())
        for core_id in stopped + failed:
            self._cores.pop(core_id, None)
        return outputs

    def abort_request(self, request_ids):
        """As LLMEngine's: ends the requests and returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            if request_id in self.output_processor:
                self.aborted.append(request_id)
            for core_id in self.output_processor.core_ids(request_id):
                self._cores.pop(core_id, None)
            out = self.output_processor.abort(request_id, time.monotonic())
            if out is not None:
                outputs.append(out)
        return outputs

    # What reads only the OutputProcessor is the real engine's own code.
    abort_all = LLMEngine.abort_all
    has_unfinished_requests = LLMEngine.has_unfinished_requests
    num_unfinished_requests = LLMEngine.num_unfinished_requests

    def stats(self) -> dict[str, float]:
        running = float(len(self._cores))
        return {"num_running": running, "num_waiting": 0.0, "kv_usage": 0.0, "kv_free_blocks": 0.0,
                "kv_total_blocks": 0.0, "prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0,
                "num_preemptions": 0.0, "compiles_after_warmup": 0.0, "prompt_tokens": 0.0,
                "generation_tokens": 0.0}

    def shutdown(self) -> None:
        pass
