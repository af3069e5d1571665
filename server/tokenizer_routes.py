"""The tokenizer routes, at the root as vLLM serves them (and as
lm-evaluation-harness's `tokenizer_backend=remote` calls them), behind the
API key like the API:

* `POST /tokenize`: `{"prompt": "..."}` (tokenized as `/v1/completions`
  tokenizes a prompt; `add_special_tokens: false` leaves out what the
  tokenizer adds, a BOS) or `{"messages": [...]}` (rendered through the chat
  template and tokenized as `/v1/chat/completions` does, tools included) →
  `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
  `return_token_strs: true`, else null);
* `POST /detokenize`: `{"tokens": [...]}` → `{"prompt": "..."}`, special
  tokens written out;
* `GET /tokenizer_info`: the special tokens, the chat template, the context
  length and the vocabulary size.

Each takes a `model` (a field, or `?model=` for the GET), which may be left
out when the server serves one model; errors come in the API's shape from
the error middleware.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from lockgate.errors import InvalidRequestError, TokenOutsideVocabulary
from lockgate.plugin_api.fields import TOKENIZE, check_fields
from lockgate.plugin_api.pipeline import count_prompt_tokens, in_worker
from lockgate.plugin_api.readers import boolean, string
from lockgate.plugin_api.request import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, parse_request
from lockgate.plugin_api.tool_calls import chat_template_for
from lockgate.server.keys import FIELD_POLICY, MODELS, PLUGIN_MANAGER, REQUEST_ID
from lockgate.server.middlewares import require_api_key
from lockgate.server.protocol import leased_model, read_json_body

tokenizer_routes = web.RouteTableDef()

#: the fields of a chat request that shape its rendered prompt
_CHAT_FIELDS = ("messages", "tools", "tool_choice", "functions", "function_call", "chat_template_kwargs",
                "reasoning_effort")


async def _model(request: web.Request, name):
    """The model named, or the one served when none is named (loaded: its
    tokenizer is read where it runs)."""
    slots = list(request.config_dict[MODELS])
    if name is None and len(slots) == 1:
        name = slots[0].name
    return await leased_model(request, name)


@tokenizer_routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    require_api_key(request)
    body = await read_json_body(request)
    check_fields(TOKENIZE, body, request.config_dict[FIELD_POLICY])
    model = await _model(request, body.get("model"))
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("send either prompt (a string) or messages (a chat)", param="prompt")
    add_special_tokens = boolean(body.get("add_special_tokens", True), "add_special_tokens")
    return_token_strs = boolean(body.get("return_token_strs", False), "return_token_strs")
    pm = request.config_dict[PLUGIN_MANAGER]
    if "prompt" in body:
        for field in _CHAT_FIELDS:
            if field in body:
                raise InvalidRequestError(f"{field} shapes a chat's prompt: send it with messages, not prompt",
                                          param=field)
        prompt = string(body["prompt"], "prompt")
        if add_special_tokens:
            # exactly as a completion's prompt: the same hooks
            typed = parse_request(COMPLETIONS_ENDPOINT, {"prompt": prompt}, request_id=request[REQUEST_ID])
            tokens = await count_prompt_tokens(pm, typed, model)
        else:
            tokens = await in_worker(lambda: model.tokenizer.encode(prompt, add_special_tokens=False))
    else:
        chat = {key: body[key] for key in _CHAT_FIELDS if key in body}
        typed = parse_request(CHAT_ENDPOINT, chat, request_id=request[REQUEST_ID],
                              thinks=model.reasoning_format is not None)
        tokens = await count_prompt_tokens(pm, typed, model)
    text = model.token_bytes.text
    return web.json_response({
        "count": len(tokens),
        "max_model_len": model.context_length,
        "tokens": tokens,
        "token_strs": [text(t) for t in tokens] if return_token_strs else None,
    })


@tokenizer_routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    require_api_key(request)
    body = await read_json_body(request)
    model = await _model(request, body.get("model"))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise InvalidRequestError("tokens must be an array of token ids (integers)", param="tokens")
    for token in tokens:
        if not 0 <= token < model.vocab_size:
            raise TokenOutsideVocabulary(
                f"token id {token} is outside the vocabulary (0..{model.vocab_size - 1})", param="tokens")
    prompt = await in_worker(
        lambda: model.tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return web.json_response({"prompt": prompt})


@tokenizer_routes.get("/tokenizer_info")
async def tokenizer_info(request: web.Request) -> web.Response:
    require_api_key(request)
    model = await _model(request, request.query.get("model"))
    tokenizer = model.tokenizer
    info: dict[str, Any] = {
        "model": model.name,
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
        "chat_template": chat_template_for(tokenizer, tools=False),
        "model_max_length": model.context_length,
        "vocab_size": model.vocab_size,
    }
    return web.json_response(info)
