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
import dataclasses
from collections.abc import Iterator

import pluggy
import structlog

from lockgate.engine import Handle, Work
from lockgate.errors import ContextLengthExceeded, InternalError, LockgateError
from lockgate.models import Model
from lockgate.plugin_api.grammars import grammar_for, with_reasoning
from lockgate.plugin_api.output import OutputParser
from lockgate.plugin_api.request import ChatRequest, CompletionRequest, GenerationRequest

log = structlog.get_logger("lockgate.pipeline")


async def run_pipeline(
    pm: pluggy.PluginManager, request: GenerationRequest, model: Model
) -> list[Handle]:
    """Prepare and enqueue `request`.

    Returns one handle per prompt (a completions request may carry several;
    handle `i` generates the choices `i * n ... i * n + n - 1`). If any step
    raises, handles already enqueued are aborted and the exception
    propagates.
    """
    loop = asyncio.get_running_loop()
    # the worker thread gets this task's context: hook calls log with the request id
    context = contextvars.copy_context()
    future = loop.run_in_executor(None, context.run, prepare_request, pm, request, model)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        # the client left while the pipeline ran: whatever it enqueues is aborted
        future.add_done_callback(_abort_enqueued)
        raise


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
    pm: pluggy.PluginManager, request: GenerationRequest, model: Model
) -> list[Handle]:
    """The pipeline itself, synchronous (runs in a worker thread).

    `lockgate_validate_request` runs once per HTTP request; the other steps
    run once per prompt.
    """
    with errors_named_for(request):
        pm.hook.lockgate_validate_request(request=request, model=model)
        params = request.sampling_params(grammar=grammar_for(request, model))
        if isinstance(request, ChatRequest) and request.reads_tool_output:
            params = dataclasses.replace(params, **tool_sampling(request, model))
        if request.prediction:
            predicted = model.tokenizer.encode(request.prediction, add_special_tokens=False)
            params = dataclasses.replace(params, prediction=tuple(int(t) for t in predicted))
        prompts = request.split() if isinstance(request, CompletionRequest) else [request]
        handles: list[Handle] = []
        try:
            for one in prompts:
                ids = prompt_token_ids(pm, one, model)
                work = Work(request_id=one.id, prompt_token_ids=ids, params=_with_thinking(params, one, model, ids))
                handle = pm.hook.lockgate_enqueue(work=work, engine=model.engine)
                if handle is None:
                    raise InternalError("no plugin enqueued the request")
                handles.append(handle)
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return handles


def _with_thinking(params, request: GenerationRequest, model: Model, prompt_ids: list[int]):
    """A chat request's sampling where the model thinks first: its tags kept
    in the text where they are special tokens, and a grammar (tools',
    `response_format`'s) constraining what follows the thinking, which it
    lets run to its closing tag."""
    fmt = model.reasoning_format
    if fmt is None or not isinstance(request, ChatRequest):
        return params
    if fmt.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if params.grammar is None:
        return params
    grammar = with_reasoning(params.grammar, fmt, opened=reasoning_opened(model, prompt_ids),
                             tokenizer=model.tokenizer, eos_token_ids=model.eos_token_ids)
    return dataclasses.replace(params, grammar=grammar)


#: prompt tokens decoded to tell whether the prompt opened the thinking
_PROMPT_TAIL_TOKENS = 8


def reasoning_opened(model: Model, prompt_ids: list[int]) -> bool:
    """Whether the model's output after this prompt starts inside its
    thinking (the template opened it)."""
    fmt = model.reasoning_format
    if fmt is None:
        return False
    tail = model.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return fmt.opened_by(tail)


def output_parser(request: ChatRequest, model: Model, handle: Handle) -> OutputParser:
    """How a chat request's output is read (the same for each of its
    choices): its thinking by the model's reasoning format, its calls by
    the tool-call format (`tool_output_format`)."""
    opened = model.reasoning_format is not None and reasoning_opened(model, handle.work.prompt_token_ids)

    def count_tokens(text: str) -> int:
        return len(model.tokenizer.encode(text, add_special_tokens=False))

    return OutputParser(model.reasoning_format, opened, tool_output_format(request, model), count_tokens)


def tool_output_format(request: ChatRequest, model: Model):
    """The tool-call format a request's output is read with (its calls parsed
    out of the text), bound to the tools offered; None when the output is
    plain text (no tools offered or used, or a model without a format)."""
    if request.reads_tool_output and model.tool_call_format is not None:
        return model.tool_call_format.with_tools(request.offered_tools)
    return None


def tool_sampling(request: ChatRequest, model: Model) -> dict:
    """What tools change in how the engine samples besides the grammar
    (`grammars.grammar_for`): the format's markers kept in the text."""
    fmt = model.tool_call_format
    return {"skip_special_tokens": not fmt.keeps_special_tokens and request.skip_special_tokens}


def _refuse_what_cannot_fit(prompt: str, model: Model) -> None:
    """Refuse a prompt too long to fit the context whatever its tokens,
    before the tokenizer sees it: tokenizing a million characters costs a
    third of a second of CPU and about 25 MB of transient memory (which,
    between the allocations of requests being served, the allocator keeps),
    only to count tokens that were never going to fit."""
    fewest = -(-len(prompt) // model.longest_token_chars)
    if fewest >= model.context_length:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {model.context_length} tokens. However, your prompt "
            f"is at least {fewest} tokens ({len(prompt)} characters), which leaves no room for a completion. "
            "Please reduce the length of the prompt.",
            subject="prompt",
        )


def prompt_token_ids(pm: pluggy.PluginManager, request: GenerationRequest, model: Model) -> list[int]:
    """The prompt of a request (one prompt of a completions request) as
    token ids: rendered (`lockgate_render_prompt`) and tokenized
    (`lockgate_tokenize`), or as the client sent them."""
    if isinstance(request, CompletionRequest) and isinstance(request.prompt, tuple):
        # the client sent token ids: it has done the template and tokenize steps itself
        return list(request.prompt)
    prompt = pm.hook.lockgate_render_prompt(request=request, model=model)
    if prompt is None:
        raise InternalError("no plugin rendered the prompt")
    _refuse_what_cannot_fit(prompt, model)
    token_ids = pm.hook.lockgate_tokenize(prompt=prompt, request=request, model=model)
    if token_ids is None:
        raise InternalError("no plugin tokenized the prompt")
    return list(token_ids)
