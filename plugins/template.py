"""Built-in `lockgate_render_prompt`: the model's chat template, or the completion prompt."""

from __future__ import annotations

import jinja2
from jinja2.exceptions import SecurityError

from lockgate.errors import InvalidMessages, InvalidRequestError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.request import ChatRequest, GenerationRequest


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` and tool calls itself."""
    return "tools" in (chat_template or "") and "tool_calls" in (chat_template or "")


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
    if not model.tokenizer.chat_template:
        raise InvalidRequestError(
            f"model {model.name} has no chat template: use /v1/completions, or start the "
            "server with --chat-template FILE",
            param="messages",
        )
    messages = [message.as_template_input() for message in request.messages]
    extra = {}
    fmt = model.tool_call_format
    if renders_tools(model.tokenizer.chat_template):
        if request.uses_tools:
            extra["tools"] = [tool.as_openai() for tool in request.offered_tools]
    elif fmt is not None:
        messages = _tools_in_text(request, messages, fmt)
    try:
        return model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except (jinja2.TemplateSyntaxError, SecurityError):
        # the template itself is broken or tried what the sandbox forbids:
        # the operator's fault whatever the conversation, so a 500
        raise
    except jinja2.TemplateError as exc:
        # the template refused this conversation (raise_exception: "roles must
        # alternate"), or needs a field these messages lack
        raise InvalidMessages(f"the chat template refused the messages: {exc}", param="messages") from exc
