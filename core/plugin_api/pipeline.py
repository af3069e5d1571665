"""The request pipeline: validate -> template -> tokenize -> enqueue.

Its input is a request `parse_request` has already typed and checked. Hooks
are synchronous; `run_pipeline` calls them in a worker thread so a slow
template or tokenizer never blocks the event loop. Everything that can
reject a request, `engine.add` included, runs here, before any response byte
is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterator

import pluggy
import structlog

from lockgate.engine import Handle, Work
from lockgate.errors import ContextLengthExceeded, InternalError, LockgateError
from lockgate.models import Model
from lockgate.plugin_api.decoding import decoding_for
from lockgate.plugin_api.request import CompletionRequest, GenerationRequest

log = structlog.get_logger("lockgate.pipeline")


async def run_pipeline(
    pm: pluggy.PluginManager, request: GenerationRequest, model: Model, pooling: str | None = None,
    truncate_to: int | None = None,
) -> list[Handle]:
    """Prepare and enqueue `request`.

    Returns one handle per prompt (a completions request may carry several;
    handle `i` generates the choices `i * n ... i * n + n - 1`). With
    `pooling` each prompt's hidden states are pooled instead of generated
    after (`Work.pooling`: embeddings), and `truncate_to` cuts a longer
    prompt to that many tokens (else one past the context is a 400). If any step raises, handles
    already enqueued are aborted and the exception propagates.
    """
    future = in_worker(prepare_request, pm, request, model, pooling, truncate_to)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        # the client left while the pipeline ran: whatever it enqueues is aborted
        future.add_done_callback(_abort_enqueued)
        raise


def in_worker(function, *args) -> asyncio.Future:
    """`function(*args)` in a worker thread, off the event loop (hooks,
    templates and tokenizers take CPU), with this task's context: what it
    logs carries the request id."""
    context = contextvars.copy_context()
    return asyncio.get_running_loop().run_in_executor(None, context.run, function, *args)


async def count_prompt_tokens(pm: pluggy.PluginManager, request: GenerationRequest, model: Model) -> list[int]:
    """The token ids of `request`'s prompt exactly as generating would count
    them (validate, render, tokenize: the same hooks, in a worker thread),
    nothing enqueued: what `/v1/messages/count_tokens` and `/tokenize` answer."""

    def count() -> list[int]:
        with errors_named_for(request):
            pm.hook.lockgate_validate_request(request=request, model=model)
            return prompt_token_ids(pm, request, model)

    return await in_worker(count)


def _abort_enqueued(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is None:
        for handle in future.result():
            handle.abort()


@contextlib.contextmanager
def errors_named_for(request: GenerationRequest) -> Iterator[None]:
    """Errors raised by code that knows no request fields (the engine, the
    grammar compiler) name a `subject`; give them this request's field as
    their `param`."""
    try:
        yield
    except LockgateError as exc:
        if exc.param is None and exc.subject is not None:
            exc.param = request.param_for(exc.subject)
        raise


def prepare_request(
    pm: pluggy.PluginManager, request: GenerationRequest, model: Model, pooling: str | None = None,
    truncate_to: int | None = None,
) -> list[Handle]:
    """The pipeline itself, synchronous (runs in a worker thread).

    `lockgate_validate_request` runs once per HTTP request; the other steps
    run once per prompt.
    """
    with errors_named_for(request):
        pm.hook.lockgate_validate_request(request=request, model=model)
        decoding = decoding_for(request, model).compile()
        prompts = request.split() if isinstance(request, CompletionRequest) else [request]
        handles: list[Handle] = []
        try:
            for one in prompts:
                ids = prompt_token_ids(pm, one, model, check_length=truncate_to is None)
                if truncate_to is not None:
                    ids = ids[:truncate_to]
                work = Work(request_id=one.id, prompt_token_ids=ids, params=decoding.sampling(ids), pooling=pooling)
                handle = pm.hook.lockgate_enqueue(work=work, engine=model.engine)
                if handle is None:
                    raise InternalError("no plugin enqueued the request")
                handles.append(handle)
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return handles


def _refuse_what_cannot_fit(prompt: str, request: GenerationRequest, model: Model) -> None:
    """Refuse a prompt too long to fit the context whatever its tokens,
    before the tokenizer sees it: tokenizing a million characters costs a
    third of a second of CPU and about 25 MB of transient memory (which,
    between the allocations of requests being served, the allocator keeps),
    only to count tokens that were never going to fit."""
    fewest = -(-len(prompt) // model.longest_token_chars)
    # a generating request needs a token of the context for its completion
    if fewest + request.generates <= model.context_length:
        return
    if not request.generates:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {model.context_length} tokens. However, your "
            f"{request.prompt_field} is at least {fewest} tokens ({len(prompt)} characters). Please reduce its "
            "length.",
            subject="prompt",
        )
    raise ContextLengthExceeded(
        f"This model's maximum context length is {model.context_length} tokens. However, your prompt "
        f"is at least {fewest} tokens ({len(prompt)} characters), which leaves no room for a completion. "
        "Please reduce the length of the prompt.",
        subject="prompt",
    )


def prompt_token_ids(pm: pluggy.PluginManager, request: GenerationRequest, model: Model,
                     check_length: bool = True) -> list[int]:
    """The prompt of a request (one prompt of a completions request) as
    token ids: rendered (`lockgate_render_prompt`) and tokenized
    (`lockgate_tokenize`), or as the client sent them. `check_length`
    refuses a text too long for the context whatever its tokens before it
    is tokenized."""
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, tuple):
        # the client sent token ids: it has done the template and tokenize steps itself
        return list(request.prompt)
    prompt = pm.hook.lockgate_render_prompt(request=request, model=model)
    if prompt is None:
        raise InternalError("no plugin rendered the prompt")
    if check_length:
        _refuse_what_cannot_fit(prompt, request, model)
    token_ids = pm.hook.lockgate_tokenize(prompt=prompt, request=request, model=model)
    if token_ids is None:
        raise InternalError("no plugin tokenized the prompt")
    return list(token_ids)
