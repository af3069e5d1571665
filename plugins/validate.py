"""Built-in `lockgate_validate_request`: this server's policy on requests.

Types and ranges are not checked here: `parse_request` has checked every
field before any hook runs, and the field tables
(`lockgate.plugin_api.fields`) have refused every field that would not act.
What is left is policy, which a deployment may want to change by replacing
this plugin: how much text one request may carry.
"""

from __future__ import annotations

from collections.abc import Iterable

from lockgate.errors import InvalidRequestError
from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.request import ChatRequest, CompletionRequest, GenerationRequest

#: messages in one chat request (OpenAI's own limit)
MAX_MESSAGES = 2048
#: characters of text in one request's messages or prompts, checked before
#: the template and the tokenizer spend time on it
MAX_TEXT_CHARS = 1_000_000


def check_text_size(param: str, texts: Iterable[str]) -> None:
    """The texts of `param` together hold at most `MAX_TEXT_CHARS` characters."""
    total = 0
    for text in texts:
        total += len(text)
        if total > MAX_TEXT_CHARS:
            raise InvalidRequestError(
                f"{param} holds more than {MAX_TEXT_CHARS} characters of text; that is the limit",
                param=param,
            )


def check_size(request: GenerationRequest) -> None:
    if isinstance(request, ChatRequest):
        if len(request.messages) > MAX_MESSAGES:
            raise InvalidRequestError(
                f"messages holds {len(request.messages)} messages; the limit is {MAX_MESSAGES}",
                param="messages",
            )
        check_text_size("messages", (text for m in request.messages for text in (m.name or "", m.content)))
    elif isinstance(request, CompletionRequest):
        check_text_size("prompt", (p for p in request.prompts if isinstance(p, str)))
    if request.prediction:
        check_text_size("prediction", [request.prediction])


@hookimpl
def lockgate_validate_request(request: GenerationRequest, model) -> None:
    check_size(request)
