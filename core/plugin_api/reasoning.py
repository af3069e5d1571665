"""Reasoning output's plugin interface: a model that thinks before it
answers (DeepSeek-R1 and its distills, QwQ, Qwen3) writes its thinking
between tags, `<think>...</think>`, then the answer. A `ReasoningFormat`,
offered by a plugin through `lockgate_register_reasoning_formats`, knows one
way of writing it: how to tell the thinking from the answer, whole or as it
streams, and whether a prompt has already opened the thinking (a template
that ends its generation prompt with `<think>`, so the output starts
inside it).

The built-in formats are tag pairs; a format for another way of writing
overrides `reader` (and `opened_by`, `grammar_prefix`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import ClassVar

from lockgate.plugin_api.tool_calls import choose_format, partial_suffix


@dataclasses.dataclass
class Split:
    """Some output, told apart: the thinking, and the answer."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: "Split") -> "Split":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningFormat:
    """One family's way of writing its thinking: between `start` and `end`."""

    #: the name `--reasoning-format` and `lockgate plugins` use
    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    #: whether the tags are special tokens of the vocabulary, to be kept in
    #: the text for this format to see them
    keeps_special_tokens: ClassVar[bool] = False
    #: whether the output is thinking until `end` even when nothing opened
    #: it (DeepSeek-R1, whose template may or may not open it, always thinks)
    always_thinks: ClassVar[bool] = False

    @classmethod
    def fits(cls, chat_template: str | None) -> bool:
        """Whether a model with this chat template writes its thinking this way."""
        return False

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with `prompt_tail` (its last tokens,
        special ones kept) leaves the output inside the thinking: the
        generation prompt ends with the opening tag (not with the closing
        one, which a template writes to switch thinking off), or, for a
        model that always thinks, with neither."""
        tail = prompt_tail.rstrip()
        if tail.endswith(self.end):
            return False
        return tail.endswith(self.start) or self.always_thinks

    def reader(self, *, opened: bool) -> "ReasoningReader":
        """A reader of one choice's output; `opened`: it starts inside the thinking."""
        return ReasoningReader(self.start, self.end, opened=opened)

    def split(self, text: str, *, opened: bool) -> Split:
        """A whole output told apart, exactly as `reader` tells it streamed."""
        reader = self.reader(opened=opened)
        split = reader.feed(text)
        split += reader.finish()
        return split

    def grammar_prefix(self, *, opened: bool) -> str:
        """A Lark expression for the thinking a constrained output may
        start with (the grammar's own start follows it): its text and
        closing tag when the prompt opened it, else the whole of it,
        optional."""
        if opened:
            return "think_text"
        return f"({json.dumps(self.start)} think_text)?"

    def grammar_rules(self) -> str:
        """The Lark rules `grammar_prefix` uses: the thinking's text runs
        to the first closing tag."""
        return f"think_text[lazy]: /(?s:.*){_regex(self.end)}/\n"


def _regex(text: str) -> str:
    """`text` as a literal in a Lark regex (Rust's syntax): every character
    that is not a letter or digit as its code point."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


class ReasoningReader:
    """Reads one choice's output as it comes: the thinking, then the answer.

    Before the thinking is known to start (`<think>` at the very start of
    the output, after white space) text is held; inside it, a tail that may
    begin the closing tag is held. White space around the thinking is not
    part of either: the answer starts after the white space that follows the
    closing tag, and the thinking never ends in white space. Whatever is
    held goes out at `finish`, as the part it was in.
    """

    PENDING, THINKING, ANSWER = "pending", "thinking", "answer"

    def __init__(self, start: str, end: str, *, opened: bool) -> None:
        self.start, self.end = start, end
        self.state = self.THINKING if opened else self.PENDING
        #: inside the thinking and nothing of it sent yet: leading white space
        #: (and a repeated opening tag) are dropped
        self.thinking_started = False
        self.held = ""
        #: the answer's leading white space is dropped
        self.answer_started = False

    def feed(self, piece: str) -> Split:
        """Take more output; return what of each part can go out now."""
        self.held += piece
        out = Split()
        if self.state == self.PENDING:
            start = self.held.lstrip()
            if start.startswith(self.start):
                self.state = self.THINKING
                self.held = start[len(self.start):]
            elif not start or self.start.startswith(start):
                return out  # too little text yet to tell
            else:
                self.state = self.ANSWER
                self.answer_started = True  # no thinking: the text is the answer as written
        if self.state == self.THINKING:
            out.reasoning = self._thinking()
        if self.state == self.ANSWER:
            out.content = self._answer()
        return out

    def finish(self) -> Split:
        """The end of the output: whatever was held, as the part it was in."""
        held, self.held = self.held, ""
        if self.state == self.PENDING:
            return Split(content=held)
        if self.state == self.THINKING:
            if not self.thinking_started:
                held = self._drop_opening(held)
            return Split(reasoning=held.rstrip())
        return Split(content=held if self.answer_started else held.lstrip())

    def _thinking(self) -> str:
        if not self.thinking_started:
            self.held = self._drop_opening(self.held)
            if not self.held or self.start.startswith(self.held):
                return ""
            self.thinking_started = True
        found = self.held.find(self.end)
        if found >= 0:
            reasoning, self.held = self.held[:found].rstrip(), self.held[found + len(self.end):]
            self.state = self.ANSWER
            return reasoning
        # hold a tail that may begin the closing tag, and trailing white space
        keep = partial_suffix(self.held, self.end)
        body = self.held[: len(self.held) - keep]
        sent = body.rstrip()
        self.held = self.held[len(sent):]
        return sent

    def _answer(self) -> str:
        if not self.answer_started:
            self.held = self.held.lstrip()
            if not self.held:
                return ""
            self.answer_started = True
        out, self.held = self.held, ""
        return out

    def _drop_opening(self, text: str) -> str:
        """The thinking's start without white space, or an opening tag the
        model wrote again after a template opened it."""
        text = text.lstrip()
        if text.startswith(self.start):
            text = text[len(self.start):].lstrip()
        return text


def choose_reasoning_format(
    formats: Sequence[type[ReasoningFormat]], name: str | None, chat_template: str | None
) -> ReasoningFormat | None:
    """The format named (`--reasoning-format`; "none" turns reading the
    thinking off), else the first that fits the template; None when none
    does.

    :raises ValueError: naming a format nobody registered.
    """
    if name == "none":
        return None
    return choose_format(formats, name, chat_template, kind="reasoning", also=("none",))
