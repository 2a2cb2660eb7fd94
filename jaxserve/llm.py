"""`LLM`: the offline API, named as in vLLM so users can switch.

`LLM(model=None, **engine_options).generate(prompts, sampling_params)` adds every prompt
to one engine at once (continuous batching) and steps until all finish, on the
caller's thread, returning RequestOutputs in input order.

Inside a training loop: `LLM(model, params=...)` generates with weights the program
already holds, `update_params(new)` swaps them between generations (no recompilation),
and `sleep()` / `wake_up()` free and restore the KV pool (and the weights) around the
training steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxserve.core import RequestOutputKind, SamplingParams
from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.outputs import RequestOutput
from jaxserve.protocol import template_messages

Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, params: Any = None, **engine_options: Any) -> None:
        """`model` gives the config and tokenizer (and the weights unless `params` are given: an nnx
        Module / State, its pure dict, or a dict of Hugging Face tensor names)."""
        self.engine = LLMEngine.from_kwargs(model, params=params, **engine_options)
        self._ids = itertools.count()

    def update_params(self, params: Any) -> None:
        """Generate with new weights from now on (all params or a subset): see LLMEngine.update_params."""
        self.engine.update_params(params)

    def sleep(self, level: int = 1) -> int:
        """Free the KV pool (level 2: and move the weights to host memory) until wake_up()."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an engine that already exists (several front ends can share one)."""
        llm = cls.__new__(cls)
        llm.engine, llm._ids = engine, itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: SamplingParams' defaults, with the
        model's generation config over them (temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens as max_tokens) unless the engine runs with generation_config="none"."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": ...}); outputs in input order.

        Without `sampling_params`: `get_default_sampling_params()`. A request that fails on its
        own (processing its output raised; logged with its traceback) comes back finished with
        `error` set and finish_reason "error"; the others are unaffected.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [self.get_default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        return self._run(list(zip(prompts, params_list)), use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        Messages are OpenAI's, as the server takes them (content as a string or as text parts, an
        assistant's tool_calls). `continue_final_message` (with add_generation_prompt=False):
        continue the last message. Each output's `prompt` is the rendered prompt text."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts = [tok.apply_chat_template(template_messages(conv), add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                 for conv in conversations]
        prompts = [{"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)} for text in texts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, items: list[tuple[PromptType, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, params in items:
                request_id = f"llm-{next(self._ids)}"
                # Only the final outputs are returned: nothing is built or copied before them.
                engine.add_request(request_id, prompt, params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
                ids.append(request_id)
            results: dict[str, RequestOutput] = {}
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:
            engine.abort_request(ids)   # nothing stays queued or holds blocks after an error or Ctrl-C
            raise
        return [results[i] for i in ids]
