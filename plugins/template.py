"""Built-in `lockgate_render_prompt`: the model's chat template, or the completion prompt."""

from __future__ import annotations

import jinja2
from jinja2.exceptions import SecurityError

from lockgate.errors import InvalidMessages, InvalidRequestError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.request import ChatRequest, GenerationRequest


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
    try:
        return model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (jinja2.TemplateSyntaxError, SecurityError):
        # the template itself is broken or tried what the sandbox forbids:
        # the operator's fault whatever the conversation, so a 500
        raise
    except jinja2.TemplateError as exc:
        # the template refused this conversation (raise_exception: "roles must
        # alternate"), or needs a field these messages lack
        raise InvalidMessages(f"the chat template refused the messages: {exc}", param="messages") from exc
