"""A request's decoding plan, assembled in one place: how the engine samples
it (its sampling parameters, the grammar its output must follow with any
thinking the model does first, which special tokens stay in the text, the
tokens it predicted) and how its output is read back (its thinking told
from its answer, its tool calls parsed).

`decoding_for(request, model)` gives the plan; the pipeline takes each
prompt's sampling from it (`Decoding.sampling`), and the endpoints their
output reader (`Decoding.reader`). Reading back compiles nothing: the
grammar is compiled the first time sampling asks for it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence

from lockgate.engine.params import SamplingParams
from lockgate.engine.structured import Grammar
from lockgate.models import Model
from lockgate.plugin_api.grammars import grammar_for, rebuild_grammar
from lockgate.plugin_api.output import OutputParser
from lockgate.plugin_api.request import ChatRequest, GenerationRequest

#: prompt tokens decoded to tell whether the prompt opened the thinking
_PROMPT_TAIL_TOKENS = 8


def decoding_for(request: GenerationRequest, model: Model) -> "Decoding":
    """The whole decoding plan of `request` on `model`."""
    return Decoding(request, model)


class Decoding:
    """How one request is decoded and read, each prompt's part from its
    token ids (a template may open the thinking itself)."""

    def __init__(self, request: GenerationRequest, model: Model) -> None:
        self.request = request
        self.model = model
        self._chat = isinstance(request, ChatRequest)
        #: the model's reasoning format, where this request's output holds thinking
        self.reasoning = model.reasoning_format if self._chat else None
        #: the tool-call format the output is read with, bound to the tools
        #: offered; None where the output is plain text
        self.tool_format = None
        if self._chat and request.reads_tool_output and model.tool_call_format is not None:
            self.tool_format = model.tool_call_format.with_tools(request.offered_tools)
        self._thinking_grammars: dict[bool, Grammar] = {}

    @functools.cached_property
    def grammar(self) -> Grammar | None:
        """The grammar the answer follows (tools', `response_format`'s or an
        extension's), compiled on first use: a bad schema raises here, a 400
        naming its field."""
        return grammar_for(self.request, self.model)

    def compile(self) -> "Decoding":
        """Compile what the plan's sampling needs, before any prompt is
        rendered: the grammar (a bad schema is its 400 now)."""
        _ = self._base
        return self

    @functools.cached_property
    def _base(self) -> SamplingParams:
        request, model = self.request, self.model
        params = request.sampling_params(grammar=self.grammar)
        skip_special = params.skip_special_tokens
        if self._chat and request.reads_tool_output:
            # a tool-call format written in special tokens keeps them in the text
            skip_special = skip_special and not model.tool_call_format.keeps_special_tokens
        if self.reasoning is not None and self.reasoning.keeps_special_tokens:
            skip_special = False
        prediction = params.prediction
        if request.prediction:
            predicted = model.tokenizer.encode(request.prediction, add_special_tokens=False)
            prediction = tuple(int(t) for t in predicted)
        return dataclasses.replace(params, skip_special_tokens=skip_special, prediction=prediction)

    def opened_thinking(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the output after this prompt starts inside the model's
        thinking (the template opened it)."""
        if self.reasoning is None:
            return False
        tail = self.model.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return self.reasoning.opened_by(tail)

    def sampling(self, prompt_ids: Sequence[int]) -> SamplingParams:
        """The engine's sampling for one prompt: where the model thinks
        first, the grammar lets the thinking run to its closing tag and
        constrains what follows."""
        params = self._base
        if self.reasoning is None or params.grammar is None:
            return params
        return dataclasses.replace(params, grammar=self._after_thinking(self.opened_thinking(prompt_ids)))

    def _after_thinking(self, opened: bool) -> Grammar:
        """The grammar after the thinking: the thinking free to its closing
        tag (all of it when the prompt `opened` it, else it may be skipped),
        then white space, then what the answer's grammar admits. Built once
        per plan for each value of `opened`."""
        if opened not in self._thinking_grammars:
            self._thinking_grammars[opened] = self._build_after_thinking(opened)
        return self._thinking_grammars[opened]

    def _build_after_thinking(self, opened: bool) -> Grammar:
        fmt, source = self.reasoning, self.grammar.source
        try:
            top = json.loads(source) if source.lstrip().startswith("{") else None
        except ValueError:
            top = None
        if not isinstance(top, dict) or not isinstance(top.get("grammars"), list) or not top["grammars"]:
            top = {"grammars": [{"lark_grammar": source}]}
        answer = {**top["grammars"][0]}
        answer["name"] = answer.get("name") or "lockgate_answer"
        thinking = (f"start: {fmt.grammar_prefix(opened=opened)} /[ \\t\\r\\n]*/ @{answer['name']}\n"
                    + fmt.grammar_rules())
        # the answer's grammar is referred to by name: none of ours refers to another by index
        top = {**top, "grammars": [{"name": "lockgate_thinking", "lark_grammar": thinking}, answer,
                                   *top["grammars"][1:]]}
        return rebuild_grammar(json.dumps(top), self.model.tokenizer, eos_token_ids=self.model.eos_token_ids)

    def reader(self, prompt_ids: Sequence[int]) -> OutputParser:
        """How the output after this prompt is read (the same for each of
        its choices): its thinking by the model's reasoning format, its
        calls by the tool-call format."""
        tokenizer = self.model.tokenizer

        def count_tokens(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False))

        return OutputParser(self.reasoning, self.opened_thinking(prompt_ids), self.tool_format,
                            count_tokens)
