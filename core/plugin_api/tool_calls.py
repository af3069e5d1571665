"""Tool calling's plugin interface: what a tool-call format is, and which
chat template a request with tools is rendered with.

A model family writes tool calls its own way (a JSON envelope, Hermes'
`<tool_call>` tags, Llama 3's bare JSON, Mistral's `[TOOL_CALLS]`). A
`ToolCallFormat`, offered by a plugin through `lockgate_register_tool_call_formats`,
knows one way: how to tell a model about tools when its chat template
cannot, the grammar that makes generation a well-formed call, and how to
read calls back out of the generated text, whole or as it streams.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from lockgate.plugin_api.grammars import JSON_LAYOUT, closed_objects


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the client offers the model."""

    name: str
    description: str | None = None
    #: a JSON schema for the arguments (an object)
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"type": "object"})
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's API and chat templates spell it."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """What the model may do with the tools offered: answer without them
    (`none`), call or answer (`auto`), call at least one (`required`), or
    call the function `name` (`function`)."""

    mode: str
    #: the function a `function` choice names
    name: str | None = None

    MODES: ClassVar[tuple[str, ...]] = ("none", "auto", "required")

    @classmethod
    def function(cls, name: str) -> "ToolChoice":
        return cls("function", name)

    @property
    def forces_call(self) -> bool:
        """Whether the output must be a call (`required`, or a named function)."""
        return self.mode in ("required", "function")

    def __str__(self) -> str:
        return f"function {self.name}" if self.mode == "function" else self.mode


NO_TOOLS = ToolChoice("none")
AUTO = ToolChoice("auto")


def new_call_id() -> str:
    """A fresh call id as OpenAI's look: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call of a tool: its id, the tool's name and the arguments as JSON text."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ParsedOutput:
    """Generated text read as a tool-call format writes it."""

    #: the text that is not a call (None when there is none)
    content: str | None
    calls: list[ToolCall]


def arguments_text(arguments: Any) -> str:
    """Arguments as the JSON text OpenAI's `arguments` field holds."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def lark_json(schema: Mapping[str, Any]) -> str:
    """A JSON schema as a document of its own inside an llguidance Lark
    grammar: its `$ref`s (`#/$defs/...`, `#`) resolve against `schema`
    itself, wherever in the grammar it stands; objects closed as in
    `response_format`, JSON laid out as everywhere else."""
    layout = {"x-guidance": dict(JSON_LAYOUT, lenient=True)}
    return "%json " + json.dumps({**layout, **closed_objects(schema)}, ensure_ascii=False)


#: the Lark rule `calls_grammar` defines as one call of any of the tools
CALL = "call"


def call_lark(tool: Tool, *, arguments_key: str = "arguments") -> str:
    """One call of `tool` as a Lark expression: the JSON object
    `{"name": "<its name>", "<arguments_key>": <arguments>}`, laid out as
    all generated JSON is. The arguments are a `%json` document of their
    own, so a tool's parameters compile as the document their author wrote
    (never embedded in a larger schema, where their pointers would not
    resolve)."""
    opening = json.dumps({"name": tool.name, arguments_key: 0}, ensure_ascii=False)[: -len("0}")]
    return f"{lark_string(opening)} {lark_json(tool.parameters)} {lark_string('}')}"


def calls_grammar(start: str, tools: Sequence[Tool], *, arguments_key: str = "arguments") -> str:
    """A Lark grammar: `start` is the start rule's expression, in which
    `call` (`CALL`) stands for one call of any of `tools`."""
    calls = " | ".join(call_lark(t, arguments_key=arguments_key) for t in tools)
    return f"start: {start}\n{CALL}: {calls}\n"


def repeated(item: str, separator: str, most: int) -> str:
    """A Lark expression: `item` once, then up to `most - 1` more times,
    each after `separator` (a grammar that lets a list of calls end)."""
    if most <= 1:
        return f"({item})"
    return f"({item}) ({lark_string(separator)} ({item})){{0,{most - 1}}}"


def lark_string(text: str) -> str:
    return json.dumps(text)


class ToolCallFormat(abc.ABC):
    """One family's way of writing tool calls."""

    #: the name `--tool-call-format` and `lockgate plugins` use
    name: ClassVar[str]
    #: whether its output needs special tokens kept in the text (markers
    #: such as `[TOOL_CALLS]` that are special tokens of the vocabulary)
    keeps_special_tokens: ClassVar[bool] = False

    @classmethod
    def fits(cls, chat_template: str | None) -> bool:
        """Whether a model with this chat template writes calls this way."""
        return False

    @abc.abstractmethod
    def instructions(self, tools: Sequence[Tool]) -> str:
        """What to add to the system message, for a chat template that
        cannot render tools itself: the tools and how to call them."""

    @abc.abstractmethod
    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """An assistant's earlier calls as this format writes them (for
        a chat template that cannot render them itself)."""

    @abc.abstractmethod
    def grammar(self, tools: Sequence[Tool], *, required: bool, max_calls: int) -> str | None:
        """An llguidance Lark grammar for the output: with `required`, at
        least one and at most `max_calls` calls of `tools` (1 when the
        client turned `parallel_tool_calls` off, else the server's
        `--max-tool-calls`); without, text or such calls. Each tool's
        parameters go in as a document of their own (`lark_json`,
        `call_lark`, `calls_grammar`). None leaves generation
        unconstrained."""

    def answer_grammar(self) -> str | None:
        """A grammar for an answer without calls, in a conversation that has
        used tools (`tool_choice: "none"` after calls and results), for a
        format whose answers are written differently from free text there.
        None: free text."""
        return None

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Read a whole output. Text that does not parse as calls is content."""

    def start_markers(self) -> Sequence[str]:
        """Texts that begin a call wherever they appear: a stream holds text
        back from the first one on, to be parsed whole at the end. With no
        start or leading markers the output is held back entirely."""
        return ()

    def leading_markers(self) -> Sequence[str]:
        """Texts that begin a call only at the start of the output (after
        white space): a stream that starts with one is held back whole."""
        return ()

    def stream(self) -> "StreamedOutput":
        return StreamedOutput(self)

    def with_tools(self, tools: Sequence[Tool]) -> "ToolCallFormat":
        """This format for one request that offers `tools`: a format whose
        output says less than the schemas (Qwen3-Coder's parameters are
        bare text, whatever their type) reads it by them. The server calls
        it before `parse` and `stream`; the default is the format itself."""
        return self

    def new_call_id(self) -> str:
        """An id for a call read from the output (`call_` and 24 hex digits
        by default; a model whose template checks the ids it sent back,
        Mistral's, needs them in its own shape)."""
        return new_call_id()

    def template_call_id(self, call_id: str) -> str:
        """The id the chat template gets for an earlier call's `call_id`
        (in `tool_calls[].id` and the answering `tool_call_id` alike), for
        a template that refuses ids of another shape. The same id always
        maps to the same one. The default passes it on."""
        return call_id


class StreamedOutput:
    """Reads a streamed output: text is passed on as it comes until a call
    may be starting; from there on it is held and parsed at the end."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.format = fmt
        self.markers = tuple(fmt.start_markers())
        self.leading = tuple(fmt.leading_markers())
        self.text = ""
        self.sent = 0
        self.holding = not self.markers and not self.leading

    def feed(self, piece: str) -> str:
        """Take more generated text; return the content that can go out now."""
        self.text += piece
        if self.holding:
            return ""
        if self.leading and self.sent == 0:
            start = self.text.lstrip()
            if any(start.startswith(m) for m in self.leading):
                self.holding = True
                return ""
            if not start or any(m.startswith(start) for m in self.leading):
                return ""  # too little text yet to tell
            self.leading = ()
        found = [i for i in (self.text.find(m, self.sent) for m in self.markers) if i >= 0]
        if found:
            self.holding = True
            return self._release(min(found))
        # keep back a tail that may be the start of a marker
        keep = max((partial_suffix(self.text, m) for m in self.markers), default=0)
        return self._release(len(self.text) - keep)

    def finish(self) -> ParsedOutput:
        """The end: the content not yet sent, and the calls."""
        rest = self.text[self.sent :]
        if not self.holding:
            return ParsedOutput(rest or None, [])
        return self.format.parse(rest)

    def _release(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of
    `marker`: what a stream holds back, as it may begin the marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def named_chat_templates(tokenizer) -> dict[str, str]:
    """The tokenizer's chat templates by name (`templates_by_name`: its
    `chat_template` as "default", and its `named_chat_templates`)."""
    # here: lockgate.models imports this module while it loads
    from lockgate.models.chat_template import templates_by_name

    return templates_by_name(getattr(tokenizer, "chat_template", None),
                             getattr(tokenizer, "named_chat_templates", None))


def chat_template_for(tokenizer, *, tools: bool) -> str | None:
    """The template a request is rendered with (`pick_template`)."""
    from lockgate.models.chat_template import pick_template

    return pick_template(named_chat_templates(tokenizer), tools=tools)


def choose_tool_call_format(
    formats: Sequence[type[ToolCallFormat]], name: str | None, chat_template: str | None
) -> ToolCallFormat | None:
    """The format named (`--tool-call-format`), else the first that fits the
    template; None when none does.

    :raises ValueError: naming a format nobody registered.
    """
    return choose_format(formats, name, chat_template, kind="tool-call")


def choose_format(formats: Sequence[type], name: str | None, chat_template: str | None, *, kind: str,
                  also: Sequence[str] = ()):
    """An output format (a tool-call or a reasoning format class: `name`,
    `fits(chat_template)`), made: the one named, else the first of
    `formats` that fits the template; None when none does.

    :raises ValueError: naming a format nobody registered (the names listed,
        with the other names the setting takes, `also`).
    """
    if name is not None:
        for fmt in formats:
            if fmt.name == name:
                return fmt()
        known = ", ".join([*also, *(f.name for f in formats)]) or "none"
        raise ValueError(f"no {kind} format named {name!r}; registered: {known}")
    for fmt in formats:
        if fmt.fits(chat_template):
            return fmt()
    return None
