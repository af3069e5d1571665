"""The request pipeline: validate -> template -> tokenize -> enqueue.

Hooks are synchronous; `run_pipeline` calls them in a worker thread so a slow
template or tokenizer never blocks the event loop. Everything that can reject
a request, `engine.add` included, runs here, before any response byte is
sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pluggy
import structlog

from lockgate.engine import RequestHandle
from lockgate.errors import InternalError
from lockgate.models import Model
from lockgate.engine.params import SamplingParams
from lockgate.engine.structured import compile_response_format
from lockgate.engine import Work
from lockgate.plugin_api.request import Request

log = structlog.get_logger("lockgate.plugin_api.pipeline")


async def run_pipeline(
    pm: pluggy.PluginManager, requests: Sequence[Request], model: Model
) -> list[RequestHandle]:
    """Prepare and enqueue `requests` (the prompts of one HTTP request).

    Returns one handle per request. If any step raises, handles already
    enqueued are aborted and the exception propagates.
    """
    loop = asyncio.get_running_loop()
    future = loop.run_in_executor(None, prepare_requests, pm, list(requests), model)
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


def prepare_requests(
    pm: pluggy.PluginManager, requests: list[Request], model: Model
) -> list[RequestHandle]:
    """The pipeline itself, synchronous (runs in a worker thread).

    `lockgate_validate_request` runs once per HTTP request (all prompts share
    the body); the other steps run once per prompt.
    """
    body = requests[0].body
    pm.hook.lockgate_validate_request(request=requests[0], model=model)
    params = SamplingParams.from_body(body)
    # compiled (and checked) here so a bad schema is a 400 before any byte is sent
    grammar = compile_response_format(
        body.get("response_format"), model.tokenizer, eos_token_ids=model.eos_token_ids
    )
    if grammar is not None:
        if grammar.warnings:
            log.warning("response_format schema features ignored", warnings=list(grammar.warnings))
        params = dataclasses.replace(params, grammar=grammar)
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            work = Work(
                request_id=request.id,
                prompt_token_ids=_prompt_token_ids(pm, request, model),
                params=params,
                choice_offset=request.choice_offset,
                prompt_param="messages" if request.is_chat else "prompt",
            )
            handle = pm.hook.lockgate_enqueue(work=work, engine=model.engine)
            if handle is None:
                raise InternalError("no plugin enqueued the request")
            handles.append(handle)
    except BaseException:
        for handle in handles:
            handle.abort()
        raise
    return handles


def _prompt_token_ids(pm: pluggy.PluginManager, request: Request, model: Model) -> list[int]:
    if isinstance(request.prompt, list):
        # the client sent token ids: it has done the template and tokenize steps itself
        return list(request.prompt)
    prompt = pm.hook.lockgate_render_prompt(request=request, model=model)
    if prompt is None:
        raise InternalError("no plugin rendered the prompt")
    token_ids = pm.hook.lockgate_tokenize(prompt=prompt, request=request, model=model)
    if token_ids is None:
        raise InternalError("no plugin tokenized the prompt")
    return list(token_ids)
