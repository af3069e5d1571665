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
from collections.abc import Iterator, Sequence

import pluggy
import structlog

from lockgate.engine import Handle, Work
from lockgate.engine.structured import Grammar, compile_json_schema
from lockgate.engine.structured import compile_grammar as compile_lark
from lockgate.errors import ContextLengthExceeded, InternalError, InvalidSchema, LockgateError, UnsupportedParameter
from lockgate.models import Model
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
        grammar = compile_grammar(request, model.tokenizer, model.eos_token_ids)
        params = request.sampling_params(grammar=grammar)
        if isinstance(request, ChatRequest) and request.reads_tool_output:
            params = dataclasses.replace(params, **tool_call_params(request, model))
        prompts = request.split() if isinstance(request, CompletionRequest) else [request]
        handles: list[Handle] = []
        try:
            for one in prompts:
                work = Work(request_id=one.id, prompt_token_ids=_prompt_token_ids(pm, one, model), params=params)
                handle = pm.hook.lockgate_enqueue(work=work, engine=model.engine)
                if handle is None:
                    raise InternalError("no plugin enqueued the request")
                handles.append(handle)
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return handles


def compile_grammar(request: GenerationRequest, tokenizer, eos_token_ids: Sequence[int]) -> Grammar | None:
    """The request's `response_format` as a grammar for the model with this
    tokenizer, compiled (and checked) now so that a bad schema is a 400
    before any byte is sent."""
    output = request.response_format
    if output is None:
        return None
    return compile_schema(
        output.schema, tokenizer, eos_token_ids, strict=output.strict, param=request.param_for("schema")
    )


def compile_schema(schema, tokenizer, eos_token_ids: Sequence[int], *, strict: bool, param: str) -> Grammar:
    """One rule for every schema a client sends (`response_format`, each
    tool's parameters): compiled as the document it is; an error is a 400
    naming `param`; in a schema that is not strict, the keywords the
    grammar cannot enforce are accepted and named in a warning (strict, they
    are the 400)."""
    try:
        grammar = compile_json_schema(schema, tokenizer, strict=strict, eos_token_ids=eos_token_ids)
    except LockgateError as exc:
        exc.param = param
        raise
    if grammar.unenforced:
        log.warning("schema keywords accepted but not enforced", param=param, keywords=list(grammar.unenforced))
    return grammar


def tool_call_params(request: ChatRequest, model: Model) -> dict:
    """What tools change in how the engine samples: a grammar that makes
    the output a call (`required`, a named tool), a call or an answer
    (`auto`, where the format can say so), or an answer in the format's
    own shape (`none` after earlier calls, where it has one); and the
    format's markers kept in the text. Every tool's parameters are compiled
    first, as `response_format` is, so a bad schema is a 400 naming its
    tool. A call list ends: at most `model.max_tool_calls` calls, or one
    without `parallel_tool_calls`."""
    fmt = model.tool_call_format
    if fmt is None:
        raise UnsupportedParameter("this model has no tool-call format", param="tools")
    changes: dict = {"skip_special_tokens": not fmt.keeps_special_tokens and request.skip_special_tokens}
    if not request.uses_tools:  # tool_choice "none" in a conversation that used tools
        lark = fmt.answer_grammar()
        if lark is not None:
            changes["grammar"] = compile_lark(lark, model.tokenizer, eos_token_ids=model.eos_token_ids)
        return changes
    for i, tool in enumerate(request.offered_tools):
        compile_schema(tool.parameters, model.tokenizer, model.eos_token_ids, strict=tool.strict,
                       param=request.tool_parameters_param(i))
    choice = request.effective_tool_choice
    required = choice == "required" or choice.startswith("function:")
    max_calls = model.max_tool_calls if request.parallel_tool_calls else 1
    lark = fmt.grammar(request.forced_tools, required=required, max_calls=max_calls)
    if lark is not None:
        try:
            changes["grammar"] = compile_lark(lark, model.tokenizer, eos_token_ids=model.eos_token_ids)
        except InvalidSchema as exc:  # each compiled alone: it is their sum
            field = "tools" if request.tools else "functions"
            raise InvalidSchema(
                f"the {len(request.forced_tools)} tools' parameters compile one by one but not together "
                f"({exc.message}); send fewer tools or smaller schemas",
                param=field,
            ) from exc
    return changes


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


def _prompt_token_ids(pm: pluggy.PluginManager, request: GenerationRequest, model: Model) -> list[int]:
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
