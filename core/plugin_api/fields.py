"""Every field a request body may carry, per endpoint, and what it does.

lockgate fails closed: a client that sends a field learns whether it acted.
Each field of an endpoint is in one class:

* `IMPLEMENTED`: read and acted on;
* `ALIAS`: another server's name for an implemented field, read as it;
* `ACCEPTED`: accepted without effect by design, and the table says why
  (`user`, `metadata`, `service_tier`, ...); its type is still checked;
* `REFUSED`: a 400 `unsupported_parameter` naming it, unless its value asks
  for nothing (`typical_p: 1`, `audio: null`: `Field.neutral`).

A field in no row is refused as OpenAI refuses one, a 400 `unknown_parameter`
("Unrecognized request argument supplied: foo_bar", `param` the field);
`--accept-unknown-fields` relaxes that to accept-and-log for clients that
send vendor noise. A plugin that reads a field of its own from
`request.body` declares it (`lockgate_add_request_fields`), which makes it
known.

The module is over 450 lines because two thirds of it is the table
itself, a row a line, which reads best in one place.

`FIELDS` is the table; docs/features.md's table of request fields is
`markdown_table()` (`python -m lockgate.plugin_api.fields`), and a test
holds the two together and walks every row. Which fields are implemented
is checked against the request types' own readers, so the table cannot
claim a field the code does not read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from lockgate.errors import UnknownParameter, UnsupportedParameter
from lockgate.plugin_api.readers import Reader, boolean, json_object, string

log = structlog.get_logger("lockgate.pipeline")

IMPLEMENTED, ALIAS, ACCEPTED, REFUSED = "implemented", "alias", "accepted", "refused"
KINDS = (IMPLEMENTED, ALIAS, ACCEPTED, REFUSED)

CHAT, COMPLETIONS, RESPONSES, MESSAGES, TOKENIZE, OLLAMA_CHAT, OLLAMA_GENERATE = (
    "chat.completions", "completions", "responses", "messages", "tokenize", "ollama.chat", "ollama.generate",
)
EMBEDDINGS, OLLAMA_EMBED, RERANK, SCORE = "embeddings", "ollama.embed", "rerank", "score"
#: each endpoint's route, for the docs and error messages
ROUTES = {
    CHAT: "POST /v1/chat/completions",
    COMPLETIONS: "POST /v1/completions",
    RESPONSES: "POST /v1/responses",
    MESSAGES: "POST /v1/messages (and /v1/messages/count_tokens)",
    TOKENIZE: "POST /tokenize",
    OLLAMA_CHAT: "POST /api/chat (Ollama)",
    OLLAMA_GENERATE: "POST /api/generate (Ollama)",
    EMBEDDINGS: "POST /v1/embeddings",
    OLLAMA_EMBED: "POST /api/embed (Ollama)",
    RERANK: "POST /rerank (and /v1/rerank)",
    SCORE: "POST /v1/score (and /score)",
}


@dataclasses.dataclass(frozen=True)
class Field:
    """One row of an endpoint's table."""

    name: str
    kind: str
    #: what it does (implemented), whose name it is (alias), why it has no
    #: effect (accepted) or why it is refused: a sentence for the docs, and
    #: for a refused field the end of its error message
    note: str
    #: a refused field's values that ask for nothing, accepted as they are
    #: (null always is)
    neutral: tuple[Any, ...] = ()
    #: an accepted field's type check
    reader: Reader | None = None
    #: a value that makes the field act, or be refused (the tests send it)
    example: Any = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def asks_for_nothing(self, value: Any) -> bool:
        """Whether `value` leaves a refused field without effect."""
        return value is None or any(_same(value, n) for n in self.neutral)


def _same(value: Any, neutral: Any) -> bool:
    # JSON's types: true is not 1, and 1 is 1.0
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    numbers = type(value) in (int, float) and type(neutral) in (int, float)
    return (numbers or type(value) is type(neutral)) and value == neutral


def _one_of(*values: str) -> Reader:
    def read(value: Any, where: str) -> str:
        if value not in values:
            raise UnsupportedParameter(f"{where} must be one of {', '.join(values)}, got {value!r}", param=where)
        return value

    return read


def implemented(name: str, note: str, example: Any = True) -> Field:
    return Field(name, IMPLEMENTED, note, example=example)


def alias(name: str, of: str, example: Any = True) -> Field:
    return Field(name, ALIAS, of, example=example)


def accepted(name: str, note: str, reader: Reader | None = None, example: Any = True) -> Field:
    return Field(name, ACCEPTED, note, reader=reader, example=example)


def refused(name: str, note: str, neutral: tuple[Any, ...] = (), example: Any = True) -> Field:
    return Field(name, REFUSED, note, neutral=neutral, example=example)


# ------------------------------------------------------------------ the rows

_SAMPLING = (
    implemented("model", "the served model's name (or an alias of it)", "tiny"),
    implemented("stream", "server-sent events", True),
    implemented("n", "choices per prompt, each its own random stream", 2),
    implemented("max_tokens", "most tokens to generate per choice", 8),
    implemented("temperature", "0 is greedy", 0.5),
    implemented("top_p", "nucleus sampling", 0.9),
    implemented("seed", "the same seed and request give the same output, whatever shares the batch", 7),
    implemented("presence_penalty", "subtracted once from every token already in the output", 0.5),
    implemented("frequency_penalty", "subtracted per occurrence in the output", 0.5),
    implemented("stop", "up to 4 strings, matched across token boundaries, not included in the output", ["\n"]),
    implemented("logit_bias", "added to the named tokens' logits", {"1": -100}),
    implemented("user", "logged with the request's summary line (no other effect)", "someone"),
    implemented("top_k", "extension: the k most likely tokens only", 5),
    implemented("min_p", "extension: tokens at least this fraction of the most likely one's probability", 0.1),
    implemented("repetition_penalty", "extension: divides the logits of tokens in the prompt or output", 1.2),
    implemented("ignore_eos", "extension: end-of-generation tokens do not stop the output", True),
    implemented("min_tokens", "extension: end-of-generation tokens, stop token ids and stop strings are "
                "held back until this many tokens are out", 2),
    implemented("stop_token_ids", "extension: token ids that end the output like end-of-generation", [2]),
)
_OPENAI_GENERATION = (
    *_SAMPLING,
    implemented("stream_options", "`include_usage`: a last chunk with the usage", {"include_usage": True}),
    implemented("max_completion_tokens", "the newer name of `max_tokens`, which it wins over", 8),
    implemented("response_format", "`json_object` or `json_schema`: generation follows the schema",
                {"type": "json_object"}),
    implemented("skip_special_tokens", "extension: special tokens are left out of the text", False),
    implemented("prompt_logprobs", "extension: each prompt token's logprob, as vLLM has them", 1),
    implemented("return_token_ids", "extension: the prompt's and each choice's token ids, as vLLM has them "
                "(`prompt_token_ids`, `token_ids`), streamed and whole", True),
    implemented("prediction", "OpenAI's Predicted Outputs (`{\"type\": \"content\", \"content\": ...}`): "
                "drafts for speculative decoding, verified, never forced on the answer; "
                "`usage.completion_tokens_details` counts its accepted and rejected tokens",
                {"type": "content", "content": "Hello"}),
    implemented("structured_outputs", "extension (vLLM): one of `json`, `regex`, `choice`, `grammar` (GBNF "
                "or Lark), `json_object`; through the same grammar compiler as `response_format`",
                {"choice": ["yes", "no"]}),
    alias("guided_json", "`structured_outputs.json` (vLLM's older name)", {"type": "object"}),
    alias("guided_regex", "`structured_outputs.regex` (vLLM's older name)", "[a-z]+"),
    alias("guided_choice", "`structured_outputs.choice` (vLLM's older name)", ["yes", "no"]),
    alias("guided_grammar", "`structured_outputs.grammar` (vLLM's older name)", 'root ::= "yes" | "no"'),
    alias("grammar", "`structured_outputs.grammar` (llama.cpp's server: GBNF)", 'root ::= "yes" | "no"'),
    alias("json_schema", "`structured_outputs.json` (llama.cpp's server; SGLang's, as text)", {"type": "object"}),
    alias("regex", "`structured_outputs.regex` (SGLang)", "[a-z]+"),
    alias("ebnf", "`structured_outputs.grammar` (SGLang)", 'root ::= "yes" | "no"'),
    accepted("guided_decoding_backend", "the grammar compiler is always llguidance; what a backend is named "
             "does not change what the output must follow", string, "xgrammar"),
    accepted("metadata", "kept by OpenAI with stored completions; this server stores none", json_object, {"a": "b"}),
    accepted("store", "OpenAI's storage for distillation and evals; this server stores no completions",
             boolean, True),
    accepted("service_tier", "one tier serves every request here", string, "auto"),
    accepted("prompt_cache_key", "the prefix cache matches prompts by their tokens, with no key", string, "k"),
    accepted("prompt_cache_retention", "cached prefixes are kept until their pages are needed", string, "24h"),
    accepted("safety_identifier", "an end user's id for OpenAI's abuse monitoring; none runs here", string, "u1"),
    accepted("cache_prompt", "llama.cpp's switch for its prompt cache; lockgate's prefix cache gives the "
             "same answers with it or without it", boolean, False),
    # asked for, and not done
    refused("audio", "no model served here speaks", example={"voice": "alloy", "format": "wav"}),
    refused("web_search_options", "this server runs no tools", example={}),
    refused("verbosity", "the model's answers cannot be made shorter or longer on request", ("medium",), "low"),
    refused("guided_whitespace_pattern", "generated JSON has no free whitespace", example=" "),
    refused("best_of", "use n", example=3),
    refused("use_beam_search", "beam search is not implemented", (False,)),
    refused("length_penalty", "it weighs beams, and beam search is not implemented", (1, 1.0), 0.5),
    refused("include_stop_str_in_output", "stop strings are never in the output", (False,)),
    refused("spaces_between_special_tokens", "special tokens are decoded as the tokenizer writes them",
            (True,), False),
    refused("truncate_prompt_tokens", "a prompt over the context is a 400, never cut", example=16),
    refused("allowed_token_ids", "use logit_bias", example=[1, 2]),
    refused("bad_words", "use logit_bias", ([],), ["x"]),
    refused("priority", "requests are served first come, first served", (0,), 1),
    refused("logits_processors", "this server runs no client code", ([],), ["x"]),
    refused("return_tokens_as_token_ids", "use return_token_ids", (False,)),
    refused("cache_salt", "the prefix cache is shared by every client of a server", example="s"),
    refused("thinking_token_budget", "the thinking's length cannot be bounded apart from max_tokens", example=64),
    refused("include_reasoning", "the thinking is always returned apart from the answer", (True,), False),
    refused("n_probs", "use logprobs and top_logprobs", (0,), 5),
    refused("typical_p", "locally typical sampling is not implemented", (1, 1.0), 0.9),
    refused("mirostat", "mirostat sampling is not implemented", (0,), 2),
    refused("mirostat_tau", "mirostat sampling is not implemented", (5, 5.0), 4.0),
    refused("mirostat_eta", "mirostat sampling is not implemented", (0.1,), 0.2),
    refused("dry_multiplier", "DRY sampling is not implemented", (0, 0.0), 0.8),
    refused("dry_base", "DRY sampling is not implemented", (1.75,), 2.0),
    refused("dry_allowed_length", "DRY sampling is not implemented", (2,), 3),
    refused("dry_penalty_last_n", "DRY sampling is not implemented", (-1,), 64),
    refused("dry_sequence_breakers", "DRY sampling is not implemented", example=["\n"]),
    refused("xtc_probability", "XTC sampling is not implemented", (0, 0.0), 0.5),
    refused("xtc_threshold", "XTC sampling is not implemented", (0.1,), 0.2),
    refused("top_n_sigma", "top-n-sigma sampling is not implemented", (-1, -1.0), 1.0),
    refused("tfs_z", "tail-free sampling is not implemented", (1, 1.0), 0.9),
    refused("dynatemp_range", "dynamic temperature is not implemented", (0, 0.0), 0.5),
    refused("repeat_penalty", "llama.cpp's penalty counts only the last repeat_last_n tokens; "
            "repetition_penalty counts them all", (1, 1.0), 1.1),
    refused("repeat_last_n", "llama.cpp's window for repeat_penalty; repetition_penalty has none", (64,), 32),
    refused("penalize_nl", "newlines are penalized like any token", (False,), True),
    refused("n_keep", "a prompt over the context is a 400, never cut", (0,), 8),
    refused("samplers", "the sampling order is fixed: penalties, bias, temperature, then top-k, top-p, min-p",
            example=["top_k"]),
    refused("id_slot", "requests are not pinned to a slot", (-1,), 0),
)
_CHAT_ONLY = (
    implemented("messages", "the conversation, rendered by the chat template", [{"role": "user", "content": "Hi"}]),
    implemented("logprobs", "each output token's logprob", True),
    implemented("top_logprobs", "with logprobs: this many alternatives per token (up to 20)", 2),
    implemented("tools", "functions the model may call, in its own call format", []),
    implemented("tool_choice", "`auto`, `required`, `none` or a named function", "auto"),
    implemented("parallel_tool_calls", "false: at most one call", False),
    implemented("chat_template_kwargs", "extension: variables for the chat template (`enable_thinking`)",
                {"enable_thinking": False}),
    implemented("reasoning_effort", "`none` turns the thinking of a model that thinks off, any other effort on; "
                "refused for a model without a reasoning format (but `none`)", "none"),
    alias("functions", "`tools` (the deprecated form)", []),
    alias("function_call", "`tool_choice` (the deprecated form)", "auto"),
    refused("modalities", "this server answers in text only", (["text"],), ["text", "audio"]),
    refused("chat_template", "the template is the operator's (`--chat-template`): a client's would be code "
            "this server runs", example="{{ messages }}"),
    refused("echo", "the answer never repeats the last message", (False,)),
    refused("add_generation_prompt", "the template always opens the assistant's turn", (True,), False),
    refused("continue_final_message", "the answer always starts a new assistant turn", (False,)),
    refused("add_special_tokens", "the chat template writes the special tokens", (False,)),
    refused("documents", "retrieval documents are not passed to the template", example=[{"text": "x"}]),
    refused("mm_processor_kwargs", "this server reads text only", example={"x": 1}),
)
_COMPLETIONS_ONLY = (
    implemented("prompt", "a string, strings, token ids or lists of token ids: one prompt each", "Hi"),
    implemented("logprobs", "each output token's logprob with this many alternatives (up to 20)", 1),
    implemented("echo", "the prompt before the answer (with logprobs: its logprobs too)", True),
    refused("suffix", "text after the insertion point is not implemented", ("",), "x"),
    refused("add_special_tokens", "a text prompt is tokenized with the model's own special tokens", (True,),
            False),
)

CHAT_FIELDS = (*_OPENAI_GENERATION, *_CHAT_ONLY)
COMPLETIONS_FIELDS = tuple(f for f in _OPENAI_GENERATION if f.name != "best_of") + _COMPLETIONS_ONLY + (
    implemented("best_of", "equal to `n` it asks for nothing more and is served; any other value is a 400 "
                "`unsupported_parameter` (use `n`)", 1),
)

RESPONSES_FIELDS = (
    implemented("model", "the served model's name", "tiny"),
    implemented("input", "a string, or message, reasoning, function_call and function_call_output items", "Hi"),
    implemented("instructions", "a system message before the input (this request's only)", "Be brief."),
    implemented("stream", "typed server-sent events", True),
    implemented("max_output_tokens", "most tokens to generate", 8),
    implemented("temperature", "0 is greedy", 0.5),
    implemented("top_p", "nucleus sampling", 0.9),
    implemented("tools", "function tools (built-in tools are refused by name)", []),
    implemented("tool_choice", "`auto`, `required`, `none` or a named function", "auto"),
    implemented("parallel_tool_calls", "false: at most one call", False),
    implemented("text", "`format`: `text`, `json_object` or `json_schema`", {"format": {"type": "text"}}),
    implemented("reasoning", "`effort`: `none` turns the thinking off, any other effort on (a model with a "
                "reasoning format); `summary` is refused", {"effort": "none"}),
    implemented("store", "keep the response for `previous_response_id` and `GET /v1/responses/{id}`", False),
    implemented("previous_response_id", "continue a stored response's conversation", "resp_x"),
    implemented("metadata", "kept with the stored response and returned with it", {"a": "b"}),
    implemented("user", "logged with the request's summary line (no other effect)", "someone"),
    implemented("seed", "extension: reproducible sampling", 7),
    implemented("presence_penalty", "extension", 0.5),
    implemented("frequency_penalty", "extension", 0.5),
    implemented("stop", "extension: stop strings", ["\n"]),
    implemented("logit_bias", "extension", {"1": -100}),
    implemented("top_k", "extension", 5),
    implemented("min_p", "extension", 0.1),
    implemented("repetition_penalty", "extension", 1.2),
    implemented("ignore_eos", "extension", True),
    implemented("min_tokens", "extension: end-of-generation held back until this many tokens", 2),
    accepted("service_tier", "one tier serves every request here", string, "auto"),
    accepted("prompt_cache_key", "the prefix cache matches prompts by their tokens, with no key", string, "k"),
    accepted("prompt_cache_retention", "cached prefixes are kept until their pages are needed", string, "24h"),
    accepted("safety_identifier", "an end user's id for OpenAI's abuse monitoring; none runs here", string, "u1"),
    accepted("stream_options", "`include_obfuscation`: events are never padded here", json_object,
             {"include_obfuscation": False}),
    refused("truncation", "a conversation over the context is a 400, never cut", ("disabled",), "auto"),
    refused("background", "responses run in the foreground only", (False,)),
    refused("conversation", "conversations are chained with previous_response_id", example="conv_1"),
    refused("prompt", "stored prompt templates are not implemented", example={"id": "p"}),
    refused("include", "no extra output data is available", ([],), ["message.output_text.logprobs"]),
    refused("max_tool_calls", "bound tool calls with parallel_tool_calls", example=2),
    refused("top_logprobs", "logprobs are not served on this endpoint", (0,), 2),
    refused("verbosity", "the model's answers cannot be made shorter or longer on request", ("medium",), "low"),
)

MESSAGES_FIELDS = (
    implemented("model", "the served model's name", "tiny"),
    implemented("messages", "user and assistant turns of text, tool_use, tool_result and thinking blocks",
                [{"role": "user", "content": "Hi"}]),
    implemented("max_tokens", "most tokens to generate (required)", 8),
    implemented("system", "a system prompt: text or text blocks", "Be brief."),
    implemented("stream", "Anthropic's event sequence", True),
    implemented("temperature", "0 is greedy (at most 1)", 0.5),
    implemented("top_p", "nucleus sampling", 0.9),
    implemented("top_k", "the k most likely tokens only", 5),
    implemented("stop_sequences", "stop strings", ["\n"]),
    implemented("tools", "tools with an `input_schema`", []),
    implemented("tool_choice", "`auto`, `any`, `tool` or `none`; `disable_parallel_tool_use`", {"type": "auto"}),
    implemented("thinking", "`enabled` / `disabled` for a model with a reasoning format", {"type": "disabled"}),
    implemented("output_config", "`format`: a JSON schema the output follows",
                {"format": {"type": "json_schema", "schema": {"type": "object"}}}),
    implemented("metadata", "`user_id`, logged as the request's user", {"user_id": "u"}),
    implemented("cache_control", "`ephemeral`: what the prefix cache does for every prompt", {"type": "ephemeral"}),
    implemented("seed", "extension", 7),
    implemented("logit_bias", "extension", {"1": -100}),
    implemented("min_p", "extension", 0.1),
    implemented("repetition_penalty", "extension", 1.2),
    implemented("ignore_eos", "extension", True),
    implemented("min_tokens", "extension", 2),
    implemented("skip_special_tokens", "extension", False),
    implemented("stop_token_ids", "extension", [2]),
    implemented("parallel_tool_calls", "extension (`tool_choice.disable_parallel_tool_use` is Anthropic's)", False),
    accepted("service_tier", "one tier serves every request here", _one_of("auto", "standard_only"), "auto"),
    refused("container", "this server runs no code containers", example={"id": "c"}),
    refused("mcp_servers", "this server connects to no MCP servers", ([],), [{"url": "x"}]),
    refused("context_management", "a conversation over the context is a 400, never cut", example={"edits": []}),
)

#: chat and completions fields that shape generation alone: /tokenize,
#: given such a body to show its prompt, accepts them without effect
_GENERATION_ONLY = frozenset({
    "stream", "stream_options", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "presence_penalty", "frequency_penalty", "stop", "logit_bias", "user", "top_k", "min_p",
    "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "response_format", "skip_special_tokens",
    "prompt_logprobs", "return_token_ids", "prediction", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "grammar", "json_schema", "regex", "ebnf", "logprobs", "top_logprobs", "parallel_tool_calls",
})

TOKENIZE_FIELDS = (
    implemented("model", "the served model's name", "tiny"),
    implemented("prompt", "text, tokenized as a completion's prompt is", "Hi"),
    implemented("messages", "a chat, rendered by the chat template first", [{"role": "user", "content": "Hi"}]),
    implemented("add_special_tokens", "false: the text alone, without the model's special tokens", False),
    implemented("return_token_strs", "each token's text as well", True),
    implemented("tools", "rendered with the chat, as the template writes them", []),
    implemented("tool_choice", "as in chat (`none`: the template sees no tools)", "auto"),
    implemented("chat_template_kwargs", "variables for the chat template", {"enable_thinking": False}),
    implemented("reasoning_effort", "as in chat: the thinking switch the template reads", "none"),
    alias("functions", "`tools` (the deprecated form)", []),
    alias("function_call", "`tool_choice` (the deprecated form)", "auto"),
    # the rest of a chat or completions body, sent as it is to see its prompt
    *(accepted(f.name, "shapes what is generated, not the prompt", example=f.example)
      for f in _OPENAI_GENERATION + _CHAT_ONLY
      if f.kind in (IMPLEMENTED, ALIAS) and f.name in _GENERATION_ONLY),
    refused("add_generation_prompt", "the template always opens the assistant's turn", (True,), False),
    refused("continue_final_message", "the chat always ends with a new assistant turn", (False,)),
    refused("chat_template", "the template is the operator's (`--chat-template`)", example="{{ messages }}"),
    refused("mm_processor_kwargs", "this server reads text only", example={"x": 1}),
)

#: what Ollama's chat and generate bodies share
_OLLAMA_GENERATION = (
    implemented("model", "the served model's name (with `:latest`, the model itself)", "tiny"),
    implemented("stream", "a JSON object a line (true unless false, as Ollama)", False),
    implemented("format", "`json`, or a JSON schema the answer follows", "json"),
    implemented("options", "`num_predict`, `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, "
                "`repeat_penalty`, `presence_penalty`, `frequency_penalty` act; load-time options are the "
                "server's (`num_ctx` up to the model's context); others are refused unless they ask for nothing",
                {"temperature": 0.5, "num_predict": 2}),
    implemented("think", "true, false or an effort: the thinking of a model with a reasoning format", False),
    implemented("keep_alive", "how long the model stays loaded once idle: seconds or a duration (\"5m\"); 0 "
                "unloads it when idle, negative keeps it", "5m"),
    refused("logprobs", "logprobs are served on /v1/chat/completions", (False,)),
    refused("top_logprobs", "logprobs are served on /v1/chat/completions", (0,), 2),
)

OLLAMA_CHAT_FIELDS = (
    *_OLLAMA_GENERATION,
    implemented("messages", "system, user, assistant and tool turns (an assistant's `tool_calls` and `thinking`, "
                "a tool's `tool_name`)", [{"role": "user", "content": "Hi"}]),
    implemented("tools", "function tools", []),
)

OLLAMA_GENERATE_FIELDS = (
    *_OLLAMA_GENERATION,
    implemented("prompt", "the user's turn, in the model's template", "Hi"),
    implemented("system", "a system prompt before it", "Be brief."),
    refused("raw", "the model's template always applies", (False,)),
    refused("template", "the template is the operator's (`--chat-template`)", ("",), "{{ .Prompt }}"),
    refused("suffix", "fill-in-the-middle is not served", ("",), "}"),
    refused("context", "send the conversation to /api/chat instead", ([],), [1, 2]),
    refused("images", "this server reads text only", ([],), ["aGk="]),
)

EMBEDDINGS_FIELDS = (
    implemented("model", "the served model's name", "tiny"),
    implemented("input", "a string, an array of strings, token ids or arrays of token ids: one vector each", "Hi"),
    implemented("encoding_format", "`float`, or `base64` (little-endian float32), as the openai SDK asks",
                "base64"),
    implemented("dimensions", "the model's own size only: its embeddings are not trained to be shortened", 64),
    accepted("user", "an end-user id for abuse tracking, which this server does not track", string, "u-1"),
)

OLLAMA_EMBED_FIELDS = (
    implemented("model", "the served model's name (with `:latest`, the model itself)", "tiny"),
    implemented("input", "a string or an array of strings: one vector each", "Hi"),
    implemented("truncate", "true (the default): an input past the context is cut to it; false: a 400", False),
    implemented("dimensions", "the model's own size only: its embeddings are not trained to be shortened", 64),
    implemented("options", "load-time options are the server's (`num_ctx` up to the model's context); sampling "
                "options ask for nothing here; others are refused unless they ask for nothing", {"num_ctx": 64}),
    implemented("keep_alive", "how long the model stays loaded once idle: seconds or a duration (\"5m\"); 0 "
                "unloads it when idle, negative keeps it", "5m"),
)

RERANK_FIELDS = (
    implemented("model", "the served model's name (a reranker: a file with a classification head)", "tiny"),
    implemented("query", "what the documents are ranked against", "Hi"),
    implemented("documents", "strings or `{\"text\": ...}` objects, one score each", ["a", "b"]),
    implemented("top_n", "only the best this many, best first", 1),
    implemented("return_documents", "each result carries its document (true unless false)", False),
)

SCORE_FIELDS = (
    implemented("model", "the served model's name (a reranker: a file with a classification head)", "tiny"),
    implemented("text_1", "a text scored against each of text_2, or a list paired with text_2's", "Hi"),
    implemented("text_2", "a text or a list of texts", ["a", "b"]),
)

FIELDS: Mapping[str, Mapping[str, Field]] = {
    endpoint: {f.name: f for f in rows}
    for endpoint, rows in (
        (CHAT, CHAT_FIELDS), (COMPLETIONS, COMPLETIONS_FIELDS), (RESPONSES, RESPONSES_FIELDS),
        (MESSAGES, MESSAGES_FIELDS), (TOKENIZE, TOKENIZE_FIELDS), (OLLAMA_CHAT, OLLAMA_CHAT_FIELDS),
        (OLLAMA_GENERATE, OLLAMA_GENERATE_FIELDS), (EMBEDDINGS, EMBEDDINGS_FIELDS), (OLLAMA_EMBED, OLLAMA_EMBED_FIELDS),
        (RERANK, RERANK_FIELDS), (SCORE, SCORE_FIELDS),
    )
}


# ------------------------------------------------------------------ the check


@dataclasses.dataclass(frozen=True)
class FieldPolicy:
    """What a server does with fields outside the table: refuse them
    (the default), or accept and log them (`--accept-unknown-fields`);
    `extensions` are the fields plugins declared, per endpoint."""

    accept_unknown: bool = False
    extensions: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_plugins(cls, pm, *, accept_unknown: bool = False) -> "FieldPolicy":
        """The fields the plugins of `pm` declare (`lockgate_add_request_fields`).

        :raises ValueError: a plugin declares a field an endpoint's table has,
            or names an endpoint there is none of.
        """
        declared: dict[str, set[str]] = {}

        def register(name: str, endpoints: Iterable[str] = (CHAT, COMPLETIONS)) -> None:
            for endpoint in endpoints:
                if endpoint not in FIELDS:
                    raise ValueError(f"a plugin declares {name!r} on {endpoint!r}, which is not one of "
                                     f"{', '.join(FIELDS)}")
                if name in FIELDS[endpoint]:
                    raise ValueError(f"a plugin declares {name!r} on {endpoint}, where lockgate reads it itself")
                declared.setdefault(endpoint, set()).add(name)

        pm.hook.lockgate_add_request_fields(register=register)
        return cls(accept_unknown, {endpoint: frozenset(names) for endpoint, names in declared.items()})


#: refuse what no row names, and nothing declared by plugins
STRICT = FieldPolicy()


def check_fields(endpoint: str, body: Mapping[str, Any], policy: FieldPolicy = STRICT) -> None:
    """Hold `body` to `endpoint`'s table, field by field in the body's order.

    :raises UnsupportedParameter: (400) a refused field that asks for
        something, or an accepted one of the wrong type.
    :raises UnknownParameter: (400) a field in no row (unless the policy
        accepts those: then they are logged).
    """
    table = FIELDS[endpoint]
    extensions = policy.extensions.get(endpoint, frozenset())
    unknown = []
    for name, value in body.items():
        row = table.get(name)
        if row is None:
            if name not in extensions:
                unknown.append(name)
            continue
        if row.kind == REFUSED and not row.asks_for_nothing(value):
            raise UnsupportedParameter(f"{name} is not supported by this server: {row.note}", param=name)
        if row.kind == ACCEPTED and row.reader is not None and value is not None:
            row.reader(value, name)
    if not unknown:
        return
    if not policy.accept_unknown:
        raise UnknownParameter(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    log.warning("unknown request fields accepted and ignored", endpoint=endpoint, fields=unknown)


# ------------------------------------------------------------------ the docs


def counts() -> dict[str, dict[str, int]]:
    """Rows per class, per endpoint."""
    return {endpoint: {kind: sum(f.kind == kind for f in rows.values()) for kind in KINDS}
            for endpoint, rows in FIELDS.items()}


def markdown_table() -> str:
    """The docs' table of request fields: one per endpoint."""
    out = []
    for endpoint, rows in FIELDS.items():
        out.append(f"**{ROUTES[endpoint]}**\n")
        out.append("| field | class | what it does |")
        out.append("|---|---|---|")
        for kind in KINDS:
            for f in rows.values():
                if f.kind != kind:
                    continue
                note = {ALIAS: f"read as {f.note}", REFUSED: _refused_note(f)}.get(kind, f.note)
                out.append(f"| `{f.name}` | {kind} | {note} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _refused_note(f: Field) -> str:
    if not f.neutral:
        return f.note
    values = ", ".join(f"`{json.dumps(v)}`" for v in f.neutral)
    return f"{f.note} ({values} accepted: it asks for nothing)"


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table(), end="")
