"""Built-in `lockgate_render_prompt`: the model's chat template, or the completion prompt."""

from __future__ import annotations

import threading

import jinja2
import structlog
from jinja2.exceptions import SecurityError

from lockgate.errors import InvalidMessages, InvalidRequestError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.request import ChatRequest, GenerationRequest
from lockgate.plugin_api.tool_calls import chat_template_for

log = structlog.get_logger("lockgate.template")


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` and tool calls itself."""
    return "tools" in (chat_template or "") and "tool_calls" in (chat_template or "")


class _SystemRoleSupport:
    """Whether a template accepts a leading system message, found once per
    template by trial rendering, as llama.cpp's `caps_get` does: a template
    that renders a lone user message but refuses a system message before it
    (Gemma 2's `raise_exception('System role not supported')`), or leaves its
    text out, has no system role. Where the lone user message fails too,
    nothing can be told and the template is taken at its word."""

    _MARK = "lockgate-system-probe"
    _LIMIT = 64  # templates remembered; one or two per served model

    def __init__(self) -> None:
        self._known: dict[tuple, bool] = {}
        self._lock = threading.Lock()

    def __call__(self, tokenizer, template: str) -> bool:
        key = (template, tuple(sorted(tokenizer.special_tokens_map.items(), key=str)))
        with self._lock:
            found = self._known.get(key)
        if found is None:
            found = self._probe(tokenizer, template)
            with self._lock:
                if len(self._known) >= self._LIMIT:
                    self._known.clear()
                self._known[key] = found
        return found

    def _probe(self, tokenizer, template: str) -> bool:
        user = {"role": "user", "content": "lockgate-user-probe"}
        if self._render(tokenizer, template, [user]) is None:
            return True
        rendered = self._render(tokenizer, template, [{"role": "system", "content": self._MARK}, user])
        supported = rendered is not None and self._MARK in rendered
        if not supported:
            log.info("chat template has no system role: system messages go into the next message")
        return supported

    @staticmethod
    def _render(tokenizer, template: str, messages: list[dict]) -> str | None:
        try:
            return tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, add_generation_prompt=True
            )
        except Exception:
            return None


supports_system_role = _SystemRoleSupport()


def _system_merged(messages: list[dict]) -> list[dict]:
    """A leading system message put at the front of the message after it,
    as llama.cpp does for a template without a system role; alone, it
    becomes the user's message (llama.cpp drops it)."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0], messages[1:]
    if not rest:
        return [{**system, "role": "user"}]
    following = rest[0]
    content = system["content"] + "\n" + (following.get("content") or "")
    return [{**following, "content": content}, *rest[1:]]


def _call_ids_for_template(messages: list[dict], fmt) -> list[dict]:
    """Earlier calls' ids as the format's template wants them, the same id
    mapped the same way in `tool_calls` and in the `tool_call_id` that
    answers it."""
    mapped = []
    for message in messages:
        if "tool_calls" in message:
            message = {**message, "tool_calls": [
                {**call, "id": fmt.template_call_id(call["id"])} for call in message["tool_calls"]
            ]}
        if "tool_call_id" in message:
            message = {**message, "tool_call_id": fmt.template_call_id(message["tool_call_id"])}
        mapped.append(message)
    return mapped


def _tools_in_text(request: ChatRequest, messages: list[dict], fmt) -> list[dict]:
    """For a template that knows no tools: the tools and how to call them in
    the system message, earlier calls written as the format writes them, and
    tool results as a user turn that says which call they answer (a template
    without tools knows no `tool` role either)."""
    written = []
    calls_by_id = {c.id: c for m in request.messages for c in m.tool_calls}
    for typed, message in zip(request.messages, messages):
        if "tool_calls" in message:
            calls = fmt.render_calls(typed.tool_calls)
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = "\n".join(filter(None, [message["content"], calls]))
        elif typed.role == "tool":
            call = calls_by_id.get(typed.tool_call_id)
            about = f"{call.name}({call.arguments})" if call else (typed.name or "the tool")
            message = {"role": "user", "content": f"Result of {about}: {typed.content}"}
        written.append(message)
    messages = written
    if not request.uses_tools:
        return messages
    instructions = fmt.instructions(request.offered_tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + instructions}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


@hookimpl(trylast=True)
def lockgate_render_prompt(request: GenerationRequest, model) -> str:
    if not isinstance(request, ChatRequest):
        return request.prompt
    template = chat_template_for(model.tokenizer, tools=request.uses_tools)
    if not template:
        raise InvalidRequestError(
            f"model {model.name} has no chat template: use /v1/completions, or start the "
            "server with --chat-template FILE",
            param="messages",
        )
    messages = [message.as_template_input() for message in request.messages]
    extra = {}
    fmt = model.tool_call_format
    if renders_tools(template):
        if request.uses_tools:
            extra["tools"] = [tool.as_openai() for tool in request.offered_tools]
        if fmt is not None:
            messages = _call_ids_for_template(messages, fmt)
    elif fmt is not None:
        messages = _tools_in_text(request, messages, fmt)
    if not supports_system_role(model.tokenizer, template):
        messages = _system_merged(messages)
    if model.reasoning_format is not None and "enable_thinking" not in request.chat_template_kwargs:
        # thinking on unless the request says otherwise, as llama.cpp renders
        # (its copies of QwQ's and R1's templates close the tag without it)
        extra["enable_thinking"] = True
    try:
        return model.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True,
            **request.chat_template_kwargs, **extra,
        )
    except (jinja2.TemplateSyntaxError, SecurityError, MemoryError):
        # the template itself is broken or tried what the sandbox forbids:
        # the operator's fault whatever the conversation, so a 500
        raise
    except jinja2.TemplateError as exc:
        # the template refused this conversation (raise_exception: "roles must
        # alternate"), or needs a field these messages lack
        raise InvalidMessages(f"the chat template refused the messages: {exc}", param="messages") from exc
    except Exception as exc:
        # the template's code failed on these messages (a Hermes tool_use
        # template loops over `tools` unguarded: TypeError without tools).
        # It is this request the template cannot render, so a 400, which the
        # openai SDK does not retry; the operator learns of it from the log.
        log.warning("chat template failed on a request", error=f"{type(exc).__name__}: {exc}")
        raise InvalidMessages(
            f"this model's chat template cannot render these messages ({type(exc).__name__}: {exc})",
            param="messages",
        ) from exc
