"""The checks a request passes before it is queued: each failure is a
typed error naming what was wrong (`subject`), raised from `Engine.add`
so the HTTP layer answers it before any byte is sent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockgate.engine.pooling import POOLINGS
from lockgate.engine.work import Work
from lockgate.errors import (
    ChoicesExceedCache,
    ContextLengthExceeded,
    InvalidRequestError,
    TokenOutsideVocabulary,
    TooManyChoices,
)

if TYPE_CHECKING:
    from lockgate.engine.loop import Engine


def admitted_max_tokens(engine: "Engine", work: Work) -> int:
    """The most tokens `work` may generate on `engine` (`max_tokens`, or
    what the context leaves), or raise why it can never run there:
    an empty prompt, `n` past what the engine forks, a prompt or
    prompt-plus-completion past the context, a token id outside the
    vocabulary, more KV pages than the cache has."""
    params = work.params
    prompt_len = len(work.prompt_token_ids)
    if prompt_len == 0:
        raise InvalidRequestError("the prompt is empty", subject="prompt")
    if work.pooling is not None:
        return _admitted_pooled(engine, work)
    if params.n > engine.max_n:
        if not engine.executor.shares_prefixes:
            raise TooManyChoices(
                "n must be 1 for this model: its sliding-window attention cannot share a "
                "prompt's KV cache between choices; send n separate requests"
            )
        raise TooManyChoices(f"n must be at most {engine.max_n}")
    if prompt_len >= engine.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {engine.context_length} tokens. "
            f"However, your prompt is {prompt_len} tokens, which leaves no room "
            "for a completion. Please reduce the length of the prompt.",
            subject="prompt",
        )
    max_tokens = engine.context_length - prompt_len if params.max_tokens is None else params.max_tokens
    if prompt_len + max_tokens > engine.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {engine.context_length} tokens. "
            f"However, you requested {prompt_len + max_tokens} tokens "
            f"({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.",
            subject="max_tokens",
        )
    if params.min_tokens > max_tokens:
        raise ContextLengthExceeded(
            f"min_tokens ({params.min_tokens}) is more than the {max_tokens} tokens this prompt leaves "
            f"of the model's context of {engine.context_length}",
            subject="min_tokens",
        )
    _check_vocabulary(engine, work)
    pages = engine.scheduler.pages_alone(prompt_len, max_tokens, params.n)
    if pages > engine.executor.total_pages:
        raise ChoicesExceedCache(
            f"the request needs {pages} KV pages with n={params.n}, more than the "
            f"server's {engine.executor.total_pages}; lower n or max_tokens"
        )
    return max_tokens


def _check_vocabulary(engine: "Engine", work: Work) -> None:
    vocab_size = engine.executor.vocab_size
    params = work.params
    for subject, tokens in (
        ("prompt", work.prompt_token_ids),
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
    ):
        for token in tokens:
            if not 0 <= token < vocab_size:
                raise TokenOutsideVocabulary(
                    f"token id {token} is outside the vocabulary (0..{vocab_size - 1})", subject=subject
                )


def _admitted_pooled(engine: "Engine", work: Work) -> int:
    """A pooled request (`Work.pooling`) generates nothing (0 tokens): its
    prompt may fill the whole context, one choice, an executor that returns
    hidden states."""
    if work.pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(POOLINGS)}, got {work.pooling!r}")
    if not engine.executor.can_embed:
        raise InvalidRequestError("this model's executor cannot return hidden states, so it makes no embeddings",
                                  subject="model")
    if work.params.n != 1:
        raise TooManyChoices("a pooled prompt has one answer: n must be 1")
    prompt_len = len(work.prompt_token_ids)
    if prompt_len > engine.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {engine.context_length} tokens. "
            f"However, your input is {prompt_len} tokens. Please reduce the length of the input.",
            subject="prompt",
        )
    _check_vocabulary(engine, work)
    pages = engine.scheduler.pages(prompt_len)
    if pages > engine.executor.total_pages:
        raise ChoicesExceedCache(
            f"the input needs {pages} KV pages, more than the server's {engine.executor.total_pages}",
            subject="prompt",
        )
    return 0
