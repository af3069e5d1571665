"""Sampling parameters, read from a validated OpenAI request body."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

#: temperatures below this sample greedily (vLLM draws the line at the same place)
GREEDY_TEMPERATURE = 1e-5


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to generate for one request. Defaults follow the OpenAI API."""

    #: None: until end of turn or the context is full
    max_tokens: int | None = None
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
    #: a compiled `response_format` grammar (`lockgate.engine.structured.Grammar`), or None
    grammar: object | None = None

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE the distribution is argmax in all but
        # rounding, and dividing logits by a temperature that float32 rounds
        # to zero (2.2e-308 is valid JSON) would make them NaN.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "SamplingParams":
        """Read the parameters of a body that `lockgate_validate_request` accepted."""

        def value(name: str, default: Any) -> Any:
            found = body.get(name)
            return default if found is None else found

        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        stop = value("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        top_k = int(value("top_k", 0))
        logprobs = body.get("logprobs")
        if logprobs is True:  # chat: a flag plus top_logprobs
            logprobs = int(value("top_logprobs", 0))
        elif logprobs is False:
            logprobs = None
        return cls(
            max_tokens=None if max_tokens is None else int(max_tokens),
            temperature=float(value("temperature", 1.0)),
            top_p=float(value("top_p", 1.0)),
            top_k=max(top_k, 0),
            min_p=float(value("min_p", 0.0)),
            presence_penalty=float(value("presence_penalty", 0.0)),
            frequency_penalty=float(value("frequency_penalty", 0.0)),
            repetition_penalty=float(value("repetition_penalty", 1.0)),
            logit_bias={int(k): float(v) for k, v in value("logit_bias", {}).items()},
            seed=body.get("seed"),
            stop=tuple(stop),
            stop_token_ids=tuple(int(t) for t in value("stop_token_ids", ())),
            ignore_eos=bool(value("ignore_eos", False)),
            n=int(value("n", 1)),
            skip_special_tokens=bool(value("skip_special_tokens", True)),
            logprobs=logprobs,
        )
