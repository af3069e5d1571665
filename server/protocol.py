"""The OpenAI protocol: what the server reads and writes on the wire.

Everything shaped by the OpenAI API lives here, so the engine and core can
speak plain data (token ids, counts, finish reasons, typed errors):

* reading a body (`read_json_body`): JSON, UTF-8, an object, every string
  encodable;
* response bodies, whole and streamed (`ResponseBuilder`), `usage` and
  model cards;
* error bodies (`error_body`) and the answer to an exception
  (`error_response`, which asks the `lockgate_handle_exception` plugins).

Parsing a body into a typed request is the plugin API's
(`lockgate.plugin_api.request`): the hooks receive that object.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

import structlog
from aiohttp import web

from lockgate.engine import Delta, Usage
from lockgate.engine.sampling import TokenLogprob
from lockgate.errors import (
    ErrorResponse,
    InvalidRequestError,
    LockgateError,
    MethodNotAllowed,
    RequestTooLarge,
    RouteNotFound,
    UnsupportedMediaType,
)
from lockgate.models import Model
from lockgate.plugin_api.tool_calls import ToolCall
from lockgate.server.keys import ERROR_ANSWER, PIPELINE_REQUEST, PLUGIN_MANAGER, REQUEST_ID, SETTINGS

log = structlog.get_logger("lockgate.server")

#: a string as JSON, as json.dumps(..., ensure_ascii=False) writes it
_json_string = json.encoder.encode_basestring


# ------------------------------------------------------------------ request bodies


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


async def read_json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else (413 comes from aiohttp).

    The body must be declared JSON (415 otherwise): besides saying what the
    server reads, this keeps a web page from posting to the API without the
    CORS preflight that `--allowed-origins` governs, since a browser sends
    form and text bodies cross-origin unasked.
    """
    content_type = request.content_type  # application/octet-stream when absent
    if not (content_type == "application/json" or content_type.endswith("+json")):
        raise UnsupportedMediaType(
            f"the request body must be JSON, sent with 'Content-Type: application/json' "
            f"(got {request.headers.get('Content-Type', 'no Content-Type')!r})"
        )
    charset = request.charset
    if charset is not None and charset.lower().replace("-", "") != "utf8":
        raise UnsupportedMediaType(f"JSON bodies must be UTF-8, not {charset!r}")
    raw = await request.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    if _MAY_HOLD_SURROGATE.search(raw):
        reject_unencodable_strings(body)
    return body


# JSON's \uD800-\uDFFF escapes are the only way a body that decoded as UTF-8
# can carry a surrogate; a paired one decodes to a proper character.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def reject_unencodable_strings(body: dict[str, Any]) -> None:
    """Refuse a body any of whose strings, keys included, holds an unpaired
    surrogate (`"\\ud800"`): Python's JSON parser accepts it, but no later
    stage can (the tokenizer, the grammar compiler and the detokenizer raise,
    UTF-8 cannot encode it). Checked once here, on the whole body, so every
    string the pipeline hands onward is encodable whatever field it came in.

    :raises InvalidRequestError: (400) with `param` the field's path, as
        `messages[2].content[0].text`.
    """
    # depth first, in document order, without recursion (bodies nest deep)
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _require_encodable(value, path)
        elif isinstance(value, dict):
            for key in value:
                _require_encodable(key, path, key=True)
            stack.extend((f"{path}.{key}" if path else key, item) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", value[i]) for i in reversed(range(len(value))))


def _require_encodable(text: str, path: str, *, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"a key of {path}" if key and path else "a key of the body" if key else path
        surrogate = ord(text[exc.start])
        raise InvalidRequestError(
            f"{where} is not valid Unicode: it holds an unpaired surrogate "
            f"(\\u{surrogate:04x}) at character {exc.start}",
            param=path or None,
        ) from None


# ------------------------------------------------------------------ plain data as OpenAI JSON


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def model_card(model: Model) -> dict[str, Any]:
    """The model's entry in `GET /v1/models`."""
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "lockgate",
        "max_model_len": model.context_length,
    }


def error_body(answer: ErrorResponse) -> dict[str, Any]:
    return {
        "error": {
            "message": answer.message,
            "type": answer.type,
            "param": answer.param,
            "code": answer.code,
        }
    }


class Echo:
    """Completions' `echo`: each choice's answer starts with its prompt.

    `apply` puts the prompt's text in front of a choice's first delta and,
    when the request asked for logprobs, the prompt tokens' logprobs (which
    the engine hands over on that delta) in front of its logprobs: the
    first prompt token with a null logprob and null alternatives, as
    OpenAI reports it.

    :param prompts: per choice index, the prompt's text and token ids.
    :param top_n: alternatives per token the request's `logprobs` asks for
        (the engine may have found more, for `prompt_logprobs`).
    """

    def __init__(self, prompts: dict[int, tuple[str, list[int]]], top_n: int | None = None) -> None:
        self._waiting = dict(prompts)
        self._top_n = top_n

    def apply(self, index: int, delta: Delta) -> Delta:
        prompt = self._waiting.pop(index, None)
        if prompt is None:
            return delta
        text, token_ids = prompt
        logprobs = delta.logprobs
        if delta.prompt_logprobs is not None and self._top_n is not None:
            first = TokenLogprob(token_id=token_ids[0], logprob=None, top=None)
            prompt = [TokenLogprob(e.token_id, e.logprob, e.top[: self._top_n]) for e in delta.prompt_logprobs[1:]]
            logprobs = [first, *prompt, *(logprobs or ())]
        return dataclasses.replace(delta, text=text + delta.text, logprobs=logprobs)


class ResponseBuilder:
    """Builds the JSON of one response (or its stream chunks) for an endpoint.

    :param token_bytes: a `lockgate.models.tokenizer.TokenBytes` of the model, to
        spell out tokens in logprobs.
    """

    def __init__(self, *, chat: bool, request_id: str, model: str, token_bytes) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.token_bytes = token_bytes
        #: completions logprobs: characters of text so far per choice (text_offset)
        self._offsets: dict[int, int] = {}
        #: per include_usage, the JSON of a stream chunk around its choice
        self._templates: dict[bool, tuple[str, str]] = {}

    # ------------------------------------------------------------ logprobs

    def logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """The `logprobs` object of a choice (or of a chunk) in the endpoint's shape."""
        if entries is None:
            return None
        text = self.token_bytes.text
        if self.chat:
            def entry(token_id: int, logprob: float) -> dict[str, Any]:
                return {"token": text(token_id), "logprob": logprob, "bytes": list(self.token_bytes(token_id))}

            return {
                "content": [
                    {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                    for e in entries
                ],
                "refusal": None,
            }
        def top(e: TokenLogprob) -> dict[str, float] | None:
            # keyed by text, as OpenAI has it: of tokens spelled alike (byte
            # tokens that are not whole characters), the likeliest stands
            if e.top is None:
                return None
            spelled: dict[str, float] = {}
            for t, lp in e.top:
                spelled.setdefault(text(t), lp)
            return spelled

        offsets = []
        for e in entries:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(text(e.token_id))
        return {
            "tokens": [text(e.token_id) for e in entries],
            # an echoed prompt's first token has no logprob (nothing before it)
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets,
        }

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    # ------------------------------------------------------------ whole

    def completion(
        self,
        texts: dict[int, str],
        finish_reasons: dict[int, str | None],
        usage: Usage,
        logprobs: dict[int, list[TokenLogprob] | None],
        tool_calls: dict[int, list[ToolCall]] | None = None,
        prompt_logprobs: tuple[int, dict[int, list[TokenLogprob | None]]] | None = None,
    ) -> dict[str, Any]:
        """The whole response; a choice with `tool_calls` has them in its
        message (its `content` null when it wrote no text beside them).
        `prompt_logprobs` (the extension: how many alternatives, and each
        choice's prompt entries) goes in each completions choice, and once
        in a chat response (its choices share one prompt)."""
        choices = []
        for index in sorted(texts):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": texts[index]}
                calls = (tool_calls or {}).get(index)
                if calls:
                    message["content"] = texts[index] or None
                    message["tool_calls"] = [call.as_openai() for call in calls]
                choice = {
                    "index": index,
                    "message": message,
                    "logprobs": self.logprobs(index, logprobs.get(index)),
                    "finish_reason": finish_reasons.get(index),
                }
            else:
                choice = {
                    "index": index,
                    "text": texts[index],
                    "logprobs": self.logprobs(index, logprobs.get(index)),
                    "finish_reason": finish_reasons.get(index),
                }
                if prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs[0],
                                                                     prompt_logprobs[1].get(index))
            choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(prompt_logprobs[0], prompt_logprobs[1].get(0))
        body["usage"] = usage_body(usage)
        return body

    def prompt_logprobs(self, top_n: int, entries: list[TokenLogprob | None] | None) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token null (the first) or
        `{token id: {"logprob", "rank", "decoded_token"}}` holding the
        token and the `top_n` most likely ones."""
        if entries is None:
            return None
        text = self.token_bytes.text
        shaped: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                shaped.append(None)
                continue
            position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                              "decoded_token": text(entry.token_id)}}
            for rank, (token_id, logprob) in enumerate(entry.top[:top_n], 1):
                position.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                                    "decoded_token": text(token_id)})
            shaped.append(position)
        return shaped

    # ------------------------------------------------------------ streamed

    def _chunk(self, choices: list[dict[str, Any]], include_usage: bool) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)
        if include_usage:
            body["usage"] = None
        return body

    def role_chunk(self, index: int, include_usage: bool) -> dict[str, Any]:
        """The first chunk of a chat choice: the assistant role, no text yet."""
        return self._chunk(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            include_usage,
        )

    def delta_chunk(self, index: int, delta: Delta, include_usage: bool) -> dict[str, Any]:
        """The chunk of one engine delta, for the response's choice `index`."""
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": delta.text} if delta.text or delta.finish_reason is None else {},
                "logprobs": self.logprobs(index, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": self.logprobs(index, delta.logprobs),
                "finish_reason": delta.finish_reason,
            }
        return self._chunk([choice], include_usage)

    def delta_chunk_json(self, index: int, delta: Delta, include_usage: bool) -> str:
        """`delta_chunk` as JSON text, the same text `json.dumps` writes
        (`ensure_ascii=False`), from a template filled with the text, the
        index and the finish reason: every streamed token is one, and
        building and dumping a dict of dicts each time is most of its cost.
        Chunks with logprobs are dumped whole."""
        if delta.logprobs is not None:
            return json.dumps(self.delta_chunk(index, delta, include_usage), ensure_ascii=False)
        head, tail = self._chunk_template(include_usage)
        reason = "null" if delta.finish_reason is None else _json_string(delta.finish_reason)
        if self.chat:
            if delta.text or delta.finish_reason is None:
                body = f'{{"content": {_json_string(delta.text)}}}'
            else:
                body = "{}"
            choice = f'{{"index": {index}, "delta": {body}, "logprobs": null, "finish_reason": {reason}}}'
        else:
            choice = (f'{{"index": {index}, "text": {_json_string(delta.text)}, "logprobs": null, '
                      f'"finish_reason": {reason}}}')
        return head + choice + tail

    def _chunk_template(self, include_usage: bool) -> tuple[str, str]:
        """The JSON of a chunk before and after its one choice."""
        template = self._templates.get(include_usage)
        if template is None:
            empty = json.dumps(self._chunk([], include_usage), ensure_ascii=False)
            cut = empty.index('"choices": []') + len('"choices": [')
            template = self._templates[include_usage] = (empty[:cut], empty[cut:])
        return template

    def tool_call_chunks(self, index: int, calls: list[ToolCall], include_usage: bool) -> list[dict[str, Any]]:
        """A choice's calls as OpenAI streams them: per call, a first chunk
        with its index, id, type and name, then its arguments."""
        chunks = []
        for i, call in enumerate(calls):
            head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            tail = {"index": i, "function": {"arguments": call.arguments}}
            for part in (head, tail):
                chunks.append(self._chunk(
                    [{"index": index, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}],
                    include_usage,
                ))
        return chunks

    def finish_chunk(self, index: int, reason: str, include_usage: bool) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}], include_usage)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when `stream_options.include_usage`: no choices, the usage."""
        body = self._chunk([], include_usage=False)
        body["usage"] = usage_body(usage)
        return body


# ------------------------------------------------------------------ errors


def error_response(request: web.Request, exc: BaseException) -> ErrorResponse:
    """How to answer `exc`: the `lockgate_handle_exception` plugins are
    asked once per exception, and the answer is kept on the request (for
    the request counter and the summary log line). Never raises."""
    known = request.get(ERROR_ANSWER)
    if known is not None and known[0] is exc:
        return known[1]
    error = error_from_http_exception(request, exc) if isinstance(exc, web.HTTPException) else exc
    answer = _ask_plugins(request, error)
    request[ERROR_ANSWER] = (exc, answer)
    return answer


def _ask_plugins(request: web.Request, exc: BaseException) -> ErrorResponse:
    pipeline_request = request.get(PIPELINE_REQUEST)
    pm = request.config_dict[PLUGIN_MANAGER]
    try:
        answer = pm.hook.lockgate_handle_exception(exception=exc, request=pipeline_request)
        if isinstance(answer, ErrorResponse):
            return answer
        log.error("lockgate_handle_exception returned no ErrorResponse", returned=repr(answer))
    except Exception:
        log.exception("a lockgate_handle_exception implementation raised")
    return ErrorResponse(
        status=500,
        message="The server had an error while processing your request "
        f"(request id {request.get(REQUEST_ID)}).",
        type="server_error",
        code="internal_error",
    )


def error_from_http_exception(request: web.Request, exc: web.HTTPException) -> Exception:
    """aiohttp's own HTTP errors (routing, body size) as lockgate errors."""
    if exc.status == 404:
        return RouteNotFound(f"Unknown route: {request.method} {request.path}")
    if exc.status == 405:
        return MethodNotAllowed(
            f"Method {request.method} is not allowed for {request.path}",
            headers={"Allow": exc.headers.get("Allow", "")},
        )
    if exc.status == 413:
        limit = request.config_dict[SETTINGS].max_body_size
        return RequestTooLarge(f"The request body is larger than the limit of {limit} bytes")
    error = InvalidRequestError(exc.text or exc.reason) if exc.status < 500 else LockgateError(exc.reason)
    error.status = exc.status
    return error
