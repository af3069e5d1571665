"""Sampling parameters: how the engine generates for one request.

Built from a parsed request by `GenerationRequest.sampling_params`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: temperatures below this sample greedily (vLLM draws the line at the same place)
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request. Defaults follow the OpenAI API."""

    #: None: until end of turn or the context is full
    max_tokens: int | None = None
    #: end-of-generation, stop token ids and stop strings are held back
    #: until this many tokens are out
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    #: 0 disables
    top_k: int = 0
    #: 0 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: 1 disables; multiplicative, over prompt and output tokens (extension)
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    #: None: no logprobs; otherwise how many alternatives to report per token
    logprobs: int | None = None
    #: None: none; otherwise each prompt token's logprob (the first's None,
    #: having no context) with this many alternatives, on the first delta
    prompt_logprobs: int | None = None
    #: a compiled `response_format` grammar (`lockgate.engine.structured.Grammar`), or None
    grammar: object | None = None
    #: the predicted output (OpenAI's Predicted Outputs) as token ids: drafts
    #: to verify, never forced on the output
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE the distribution is argmax in all but
        # rounding, and dividing logits by a temperature that float32 rounds
        # to zero (2.2e-308 is valid JSON) would make them NaN.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
