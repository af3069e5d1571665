"""A chat answer's generated text read into its parts: the thinking (by
the model's reasoning format), then the answer's text and its tool calls
(by its tool-call format), whole or as it streams. Every endpoint that
answers a chat request (chat completions, Responses, Anthropic's Messages)
reads its output here, so the parts are told apart one way everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lockgate.plugin_api.reasoning import ReasoningFormat, ReasoningReader, Split
from lockgate.plugin_api.tool_calls import StreamedOutput, ToolCall, ToolCallFormat


@dataclasses.dataclass
class Output:
    """One choice's output, told apart."""

    #: the thinking; None when the model wrote none (or has no reasoning format)
    reasoning: str | None
    #: the answer's text that is not a call
    content: str
    calls: list[ToolCall]
    #: tokens the thinking took (its tags included)
    reasoning_tokens: int = 0


class OutputParser:
    """How one request's output is read: its reasoning format (and whether
    the prompt opened the thinking) and its tool-call format, either None.

    :param count_tokens: the model's token count of a text, for
        `Output.reasoning_tokens`.
    """

    def __init__(self, reasoning: ReasoningFormat | None, opened: bool, tools: ToolCallFormat | None,
                 count_tokens: Callable[[str], int]) -> None:
        self.reasoning = reasoning
        self.opened = opened
        self.tools = tools
        self.count_tokens = count_tokens

    @property
    def plain(self) -> bool:
        """Whether the output is all answer text, read as it comes."""
        return self.reasoning is None and self.tools is None

    def parse(self, text: str) -> Output:
        """A whole output read; the thinking exactly as a stream tells it."""
        split = Split(content=text) if self.reasoning is None else self.reasoning.split(text, opened=self.opened)
        if self.tools is None:
            calls, content = [], split.content
        else:
            parsed = self.tools.parse(split.content)
            calls, content = parsed.calls, parsed.content or ""
        return self._output(split, content, calls)

    def stream(self) -> "OutputReader":
        return OutputReader(self)

    def _output(self, split: Split, content: str, calls: list[ToolCall]) -> Output:
        if self.reasoning is None:
            return Output(None, content, calls)
        thought = split.reasoning or None
        tokens = 0
        if thought is not None or self.opened:
            written = ("" if self.opened else self.reasoning.start) + split.reasoning + self.reasoning.end
            tokens = self.count_tokens(written)
        return Output(thought, content, calls, tokens)


class OutputReader:
    """One choice's output as it streams: `feed` says what of the thinking
    and of the answer's text can go out now; `finish`, at the end, the rest
    and the calls (a call goes out whole, once the output has ended)."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.thinking: ReasoningReader | None = (
            None if parser.reasoning is None else parser.reasoning.reader(opened=parser.opened)
        )
        self.calls: StreamedOutput | None = None if parser.tools is None else parser.tools.stream()
        self.reasoning_text = ""
        self.content_text = ""

    def feed(self, piece: str) -> Split:
        split = Split(content=piece) if self.thinking is None else self.thinking.feed(piece)
        self.reasoning_text += split.reasoning
        if self.calls is not None:
            split.content = self.calls.feed(split.content)
        self.content_text += split.content
        return split

    def finish(self) -> tuple[Split, Output]:
        """What is left to send, and the whole choice as it was read."""
        rest = Split() if self.thinking is None else self.thinking.finish()
        self.reasoning_text += rest.reasoning
        calls: list[ToolCall] = []
        if self.calls is not None:
            rest.content = self.calls.feed(rest.content)
            parsed = self.calls.finish()
            rest.content += parsed.content or ""
            calls = parsed.calls
        self.content_text += rest.content
        return rest, self.parser._output(Split(reasoning=self.reasoning_text), self.content_text, calls)
