"""Declaring a request type's body fields, once each: `param` declares one
(its reader, its key in the body, its default), `read_fields` reads every
declared field of a body, and `same_as` declares a field as another
request type declares it (an API's own request type taking a chat field's
reader and default). `RequestOrigin` is what a request typed by an API other
than chat completions gives the chat request it becomes (`to_chat`): its
endpoint, and how an error names its fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from lockgate.errors import InvalidRequestError
from lockgate.plugin_api.readers import Reader


def param(default: Any = None, reader: Reader | None = None, *, key: str | None = None, required: bool = False,
          shared: bool = False):
    """Declare one body field: read with `reader` from `body[key]` (the
    attribute's name by default) when present and not null, else `default`
    (a `dict` default is copied for each request). `shared`: the field is
    chat's own, handed to the chat request as it is (`same_as`)."""
    metadata = {"reader": reader, "key": key, "required": required, "shared": shared}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def same_as(cls: type, name: str, *, key: str | None = None):
    """The field `name` as request type `cls` declares it (its reader and
    default), read from `key` of this body (the same name by default), and
    marked `shared`: its value is `cls`'s field of that name."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    default = field.default_factory() if field.default is dataclasses.MISSING else field.default
    return param(default, field.metadata["reader"], key=key, shared=True)


def read_fields(cls: type, body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields `cls` declares with a reader, read from `body`: those
    present and not null; a required one missing is an error."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        reader = field.metadata.get("reader")
        if reader is None:
            continue
        key = field.metadata["key"] or field.name
        value = body.get(key)
        if value is None:
            if field.metadata["required"]:
                raise InvalidRequestError(f"{key} is required", param=key)
            continue
        values[field.name] = reader(value, key)
    return values


class RequestOrigin(Protocol):
    """A request as its own API typed it (`ResponsesRequest`,
    `MessagesRequest`), kept on the chat request it becomes
    (`ChatRequest.origin`): the hooks see a chat request whose `endpoint`
    is this one's, and whose errors name this API's fields."""

    endpoint: str

    def param_for(self, subject: str) -> str | None:
        """The field an error about `subject` ("prompt", "max_tokens",
        "schema") names; None: the chat request's own answer."""

    def tool_result_param(self, index: int) -> str:
        """The field naming the call the tool result at message `index` answers."""

    def tool_parameters_param(self, index: int) -> str:
        """The field holding the `index`-th offered tool's parameters."""
