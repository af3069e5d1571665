"""The typed request: one OpenAI request body, parsed and checked once.

`parse_request` is the first step of every request, before any hook runs
and not a hook itself, so no plugin set can leave a body unchecked. Each
field below is declared once, with its JSON type, bounds and default; the
hooks then receive a `ChatRequest` or `CompletionRequest` whose values are
known to be well-typed and in range, and `GenerationRequest.sampling_params`
converts it, once, into what the engine runs. Every parse error is an
`InvalidRequestError` whose `param` is the exact field (`messages[2].content`,
`stream_options.include_usage`). Before any field is read, the body is held
to its endpoint's table of fields (`lockgate.plugin_api.fields`): a field
that would not act is refused, never silently dropped, and one in no row
is refused as OpenAI refuses it; fields a plugin declares stay readable in
`GenerationRequest.body`.

What needs the model (token ids inside the vocabulary, `n` within the
engine's limit, the prompt within the context) is checked where the model
is known, by the engine, whose errors name a `subject` that
`GenerationRequest.param_for` turns into this request's field.

Dataclasses, not pydantic or msgspec: the checks are few and flat, their
messages and `param` paths must be OpenAI's (a validation library's own
errors would need translating field by field), and the plugin API gains no
dependency that third-party plugins would have to agree with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from lockgate.engine.params import SamplingParams
from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.body import RequestOrigin, param, read_fields
from lockgate.plugin_api.constraints import read_constraint
from lockgate.plugin_api.fields import STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.readers import (
    INT64_MIN,
    MAX_TOP_LOGPROBS,
    Message,
    OutputFormat,
    Prompt,
    boolean,
    integer,
    number,
    read_chat_template_kwargs,
    read_include_usage,
    read_logit_bias,
    read_messages,
    read_prediction,
    read_prompts,
    read_reasoning_effort,
    read_response_format,
    read_stop,
    read_stop_token_ids,
    string,
)
from lockgate.plugin_api.tool_calls import AUTO, NO_TOOLS, Tool, ToolChoice
from lockgate.plugin_api.tool_readers import read_functions, read_tool_choice, read_tools

CHAT_ENDPOINT = "chat.completions"
COMPLETIONS_ENDPOINT = "completions"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """What chat completions and completions share.

    Not built directly: `parse_request` builds a `ChatRequest` or a
    `CompletionRequest` from a body.
    """

    #: the endpoint's name, `CHAT_ENDPOINT` or `COMPLETIONS_ENDPOINT`
    endpoint: ClassVar[str]

    #: the request id (`x-request-id`)
    id: str
    #: the body as sent, for plugins that read extension fields
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    model: str = param("", string)
    stream: bool = param(False, boolean)
    include_usage: bool = param(False, read_include_usage, key="stream_options")
    n: int = param(1, integer(1))
    #: 0 only with completions' `echo`: the prompt (and its logprobs) alone
    max_tokens: int | None = param(None, integer(0))
    max_completion_tokens: int | None = param(None, integer(0))
    temperature: float = param(1.0, number(0, 2))
    top_p: float = param(1.0, number(0, 1, low_open=True))
    seed: int | None = param(None, integer(INT64_MIN))
    presence_penalty: float = param(0.0, number(-2, 2))
    frequency_penalty: float = param(0.0, number(-2, 2))
    stop: tuple[str, ...] = param((), read_stop)
    logit_bias: Mapping[int, float] = param({}, read_logit_bias)
    response_format: OutputFormat | None = param(None, read_response_format)
    user: str | None = param(None, string)
    # extensions, as vLLM and llama.cpp's server name them
    #: -1 or 0 disables
    top_k: int = param(0, integer(-1))
    min_p: float = param(0.0, number(0, 1))
    repetition_penalty: float = param(1.0, number(0, 10, low_open=True))
    ignore_eos: bool = param(False, boolean)
    skip_special_tokens: bool = param(True, boolean)
    stop_token_ids: tuple[int, ...] = param((), read_stop_token_ids)
    #: each prompt token's logprob with this many alternatives (vLLM's extension)
    prompt_logprobs: int | None = param(None, integer(0, MAX_TOP_LOGPROBS))
    #: end-of-generation, stop token ids and stop strings held back until
    #: this many tokens are out (vLLM's extension)
    min_tokens: int = param(0, integer(0))
    #: the prompt's and each choice's token ids in the answer (vLLM's shape)
    return_token_ids: bool = param(False, boolean)
    #: OpenAI's Predicted Outputs (chat; completions too, here): text the
    #: answer is expected to largely be, which speculative decoding drafts
    #: from (None: none)
    prediction: str | None = param(None, read_prediction)

    @classmethod
    def checked(cls, **values: Any):
        """The request of these field values, the combinations of its
        fields checked (an `InvalidRequestError` naming the field)."""
        request = cls(**values)
        request._check_combinations()
        return request

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is a conversation rendered by the chat template
        (chat, and the Responses and Messages requests typed as chat)."""
        return False

    @property
    def completion_limit(self) -> int | None:
        """Most tokens to generate per choice: `max_completion_tokens`, the
        newer name, wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    #: the field that holds the prompt ("messages" or "prompt")
    prompt_field: ClassVar[str]
    #: whether tokens are generated after the prompt (false: embeddings' inputs, pooled)
    generates: ClassVar[bool] = True

    def param_for(self, subject: str) -> str:
        """The field of this request an error about `subject` names: the
        engine and the grammar compiler speak of "prompt", "max_tokens" and
        "schema", the client sent `messages`, `max_completion_tokens` and
        `response_format`."""
        if subject == "prompt":
            return self.prompt_field
        if subject == "max_tokens":
            return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if subject == "schema":
            if self.response_format is not None and self.response_format.param is not None:
                return self.response_format.param  # an extension's field
            return "response_format"
        return subject

    def requested_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs."""
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """How many alternatives to report per prompt token; None: none."""
        return self.prompt_logprobs

    def sampling_params(self, grammar: object | None = None) -> SamplingParams:
        """How the engine samples for this request (`grammar`: the compiled
        `response_format`)."""
        return SamplingParams(
            max_tokens=self.completion_limit,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            n=self.n,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            grammar=grammar,
        )

    def _check_combinations(self) -> None:
        if self.body.get("stream_options") is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs cannot be combined with stream (echo with logprobs streams them)",
                param="prompt_logprobs", code="unsupported_parameter",
            )
        limit = self.completion_limit
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed {self.param_for('max_tokens')} ({limit})",
                param="min_tokens",
            )
        if self.completion_limit == 0 and not self.echoes_prompt:
            raise InvalidRequestError(
                f"{self.param_for('max_tokens')} must be at least 1 (0, the prompt alone, "
                "is allowed only with echo on /v1/completions)",
                param=self.param_for("max_tokens"),
            )

    @property
    def echoes_prompt(self) -> bool:
        """Whether the answer starts with the prompt (completions' `echo`)."""
        return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatRequest(GenerationRequest):
    """A `POST /v1/chat/completions` body."""

    prompt_field: ClassVar[str] = "messages"

    messages: tuple[Message, ...] = param((), read_messages, required=True)
    logprobs: bool = param(False, boolean)
    top_logprobs: int | None = param(None, integer(0, MAX_TOP_LOGPROBS))
    tools: tuple[Tool, ...] = param((), read_tools)
    #: None: not given
    tool_choice: ToolChoice | None = param(None, read_tool_choice)
    #: variables for the chat template (vLLM's extension: `enable_thinking`, ...)
    chat_template_kwargs: Mapping[str, Any] = param({}, read_chat_template_kwargs)
    parallel_tool_calls: bool = param(True, boolean)
    #: OpenAI's effort, read as the thinking switch of a model that thinks
    #: (`chat_template_kwargs.enable_thinking`); None: not given
    reasoning_effort: str | None = param(None, read_reasoning_effort)
    # the deprecated forms of `tools` and `tool_choice`
    functions: tuple[Tool, ...] = param((), read_functions)
    function_call: ToolChoice | None = param(None, read_tool_choice)
    #: the request as its own API typed it where that is not chat completions
    #: (a `ResponsesRequest`, a `MessagesRequest`: `body.RequestOrigin`),
    #: which says the endpoint and names the fields errors point at
    origin: RequestOrigin | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def endpoint(self) -> str:
        """`CHAT_ENDPOINT`, or the API's the request came in by ("responses", "messages")."""
        return CHAT_ENDPOINT if self.origin is None else self.origin.endpoint

    def param_for(self, subject: str) -> str:
        named = None if self.origin is None else self.origin.param_for(subject)
        return super().param_for(subject) if named is None else named

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def is_chat(self) -> bool:
        return True

    @property
    def offered_tools(self) -> tuple[Tool, ...]:
        return self.tools or self.functions

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """What the model may do with the tools: "none" without tools;
        "auto" when tools came without a choice."""
        if not self.offered_tools:
            return NO_TOOLS
        return self.tool_choice or self.function_call or AUTO

    @property
    def uses_tools(self) -> bool:
        """Whether the model sees the tools (tools with "none" are plain chat)."""
        return self.effective_tool_choice.mode != "none"

    @property
    def has_tool_history(self) -> bool:
        """Whether earlier turns called tools."""
        return any(m.tool_calls or m.role == "tool" for m in self.messages)

    @property
    def reads_tool_output(self) -> bool:
        """Whether the output is read as a tool-call format writes it: tools
        are offered, or earlier turns used them."""
        return self.uses_tools or self.has_tool_history

    @property
    def forced_tools(self) -> tuple[Tool, ...]:
        """The tools a call must be of: the named one, or all."""
        choice = self.effective_tool_choice
        if choice.mode == "function":
            return tuple(t for t in self.offered_tools if t.name == choice.name)
        return self.offered_tools

    def _check_combinations(self) -> None:
        super()._check_combinations()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        for field, tools in (("tool_choice", self.tools), ("function_call", self.functions)):
            choice = getattr(self, field)
            if choice is None:
                continue
            if not tools and not self.offered_tools:
                raise InvalidRequestError(f"{field} is only allowed when tools are given", param=field)
            if choice.mode == "function" and not any(t.name == choice.name for t in self.offered_tools):
                raise InvalidRequestError(f"{field} names {choice.name!r}, which is not among the tools", param=field)
        if self.uses_tools and self.response_format is not None:
            raise InvalidRequestError(
                "response_format cannot be combined with tools (unless tool_choice is 'none')",
                param=self.param_for("schema"), code="unsupported_parameter",
            )
        answered: set[str] = set()
        for i, message in enumerate(self.messages):
            answered.update(c.id for c in message.tool_calls)
            if message.role != "tool" or (message.tool_call_id is None and message.name is not None):
                continue  # a legacy `function` message names its function, not a call
            where = self._tool_result_param(i)
            if message.tool_call_id is None:
                raise InvalidRequestError(f"{where} is required in a tool message", param=where)
            if message.tool_call_id not in answered:
                raise InvalidRequestError(
                    f"{where} {message.tool_call_id!r} answers no earlier tool call", param=where
                )

    def _tool_result_param(self, index: int) -> str:
        """The field that names the call the tool result at message `index` answers."""
        if self.origin is not None:
            return self.origin.tool_result_param(index)
        return f"messages[{index}].tool_call_id"

    def tool_parameters_param(self, index: int) -> str:
        """The field that holds the `index`-th offered tool's parameters schema."""
        if self.origin is not None:
            return self.origin.tool_parameters_param(index)
        if self.tools:
            return f"tools[{index}].function.parameters"
        return f"functions[{index}].parameters"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompletionRequest(GenerationRequest):
    """A `POST /v1/completions` body. It may carry several prompts;
    `split` gives one request per prompt, each run through the pipeline."""

    endpoint: ClassVar[str] = COMPLETIONS_ENDPOINT
    prompt_field: ClassVar[str] = "prompt"

    prompts: tuple[Prompt, ...] = param((), read_prompts, key="prompt", required=True)
    logprobs: int | None = param(None, integer(0, MAX_TOP_LOGPROBS))
    echo: bool = param(False, boolean)
    best_of: int | None = param(None, integer(1))

    @property
    def prompt(self) -> Prompt:
        """This request's prompt (the first, before `split`)."""
        return self.prompts[0]

    def split(self) -> list["CompletionRequest"]:
        """One request per prompt; ids get a `-i` suffix when there are several."""
        if len(self.prompts) == 1:
            return [self]
        return [
            dataclasses.replace(self, id=f"{self.id}-{i}", prompts=(prompt,))
            for i, prompt in enumerate(self.prompts)
        ]

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        # an echoed prompt has logprobs like the tokens after it; with the
        # extension too, the engine finds the larger number of alternatives
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted, default=None)

    @property
    def echoes_prompt(self) -> bool:
        return self.echo

    def _check_combinations(self) -> None:
        super()._check_combinations()
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedParameter(
                "best_of is not supported by this server: use n (best_of equal to n is accepted)", param="best_of"
            )


REQUEST_TYPES: dict[str, type[GenerationRequest]] = {
    CHAT_ENDPOINT: ChatRequest,
    COMPLETIONS_ENDPOINT: CompletionRequest,
}


def with_thinking(values: dict[str, Any], effort: str | None, *, thinks: bool, where: str) -> None:
    """A reasoning effort (`effort`, read from `where`) as the template's
    thinking switch (`thinking_switch`): `none` off, any other effort on."""
    if effort is not None:
        thinking_switch(values, effort != "none", thinks=thinks, where=where, said=effort)


def thinking_switch(values: dict[str, Any], on: bool | None, *, thinks: bool, where: str, said: Any = None) -> None:
    """Set the chat template's thinking switch (`enable_thinking`) in
    `values` to `on` (None: leave it). A model that does not think
    (`thinks` false) has nothing to switch: asking for its thinking asks
    for what it cannot do, switching it off asks for nothing.

    :raises UnsupportedParameter: `on` for a model that does not think.
    :raises InvalidRequestError: a switch that contradicts
        `chat_template_kwargs.enable_thinking` (`said`: the value sent).
    """
    if on is None:
        return
    if not thinks:
        if on:
            raise UnsupportedParameter(
                f"{where} is not supported for this model: it writes no reasoning apart from its answer",
                param=where,
            )
        return
    kwargs = dict(values.get("chat_template_kwargs") or {})
    if kwargs.get("enable_thinking", on) != on:
        raise InvalidRequestError(
            f"{where} {on if said is None else said!r} contradicts chat_template_kwargs.enable_thinking", param=where
        )
    kwargs["enable_thinking"] = on
    values["chat_template_kwargs"] = kwargs


def parse_request(
    endpoint: str,
    body: Mapping[str, Any],
    *,
    request_id: str,
    fields: FieldPolicy = STRICT,
    thinks: bool = False,
) -> GenerationRequest:
    """Read `body` (a decoded JSON object) as a request to `endpoint`, for
    a model that thinks (`thinks`: it has a reasoning format) or not.

    :raises InvalidRequestError: (400) naming the first field that is
        unknown (`fields` says what else is), refused, missing, of the wrong
        type or out of range.
    """
    check_fields(endpoint, body, fields)
    cls = REQUEST_TYPES[endpoint]
    values = read_fields(cls, body)
    values["response_format"] = read_constraint(body, values.get("response_format"), "response_format")
    with_thinking(values, values.get("reasoning_effort"), thinks=thinks, where="reasoning_effort")
    return cls.checked(id=request_id, body=body, **values)
