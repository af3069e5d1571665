"""Constrained decoding at compile time: a request's grammar, compiled and
checked in the request pipeline so that every problem with a schema is a
400 (`InvalidSchema`) before any response byte is sent. `grammar_for` gives a
request its grammar: its tools' (a tool-call format's Lark grammar, each
tool's parameters compiled first) or its `response_format`'s JSON schema.
The engine runs the result (`lockgate.engine.structured`).

Schemas are bounded before llguidance sees them (`check_schema_limits`),
closed to undeclared keys (`closed_objects`), and compiled on a large-stack
thread. JSON is generated on one line with a space after `,` and `:`
(`{"a": 1, "b": [1, 2]}`, Python's `json.dumps` layout). JSON allows any
whitespace there, but free whitespace lets a small model loop on newlines
until max_tokens; a schema can still choose its own layout through
llguidance's top-level `"x-guidance"` key.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import structlog

from lockgate.engine.structured import Grammar, MatcherError
from lockgate.errors import InvalidSchema, LockgateError, UnsupportedParameter
from lockgate.memory import trim_allocator
from lockgate.native import run_with_large_stack
from lockgate.plugin_api.grammar_errors import invalid as _invalid
from lockgate.plugin_api.schema_limits import (
    MAX_SCHEMA_EXPANDED_DEPTH,
    MAX_SCHEMA_NESTING,
    MAX_SCHEMA_NODES,
    check_schema_limits,
)

if TYPE_CHECKING:
    from lockgate.models import Model
    from lockgate.plugin_api.readers import OutputFormat
    from lockgate.plugin_api.request import ChatRequest, GenerationRequest

__all__ = [
    "JSON_LAYOUT",
    "MAX_SCHEMA_EXPANDED_DEPTH",
    "MAX_SCHEMA_NESTING",
    "MAX_SCHEMA_NODES",
    "check_schema_limits",
    "closed_objects",
    "compile_grammar",
    "compile_json_schema",
    "compile_output_format",
    "compile_schema",
    "compile_text_grammar",
    "grammar_for",
    "prepare_tokenizer",
    "rebuild_grammar",
]

log = structlog.get_logger("lockgate.pipeline")

# Applied before the schema's own "x-guidance" options, so a schema may
# override them.
#: how generated JSON is laid out (see the module docstring)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Error texts without the parser state and the whole grammar appended: the
# message goes back to the client, which already has its schema.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# tokenizer -> {eos ids -> LLTokenizer}. Building an LLTokenizer walks the
# whole vocabulary (most of a second for 49k tokens), so it is done once per
# tokenizer object; weak keys let an unloaded model's tokenizer go.
_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_tokenizers_lock = threading.Lock()


def prepare_tokenizer(tokenizer, *, eos_token_ids: Sequence[int] | None = None) -> None:
    """Build and cache llguidance's view of `tokenizer` now.

    Optional: `compile_json_schema` builds it on first use, which costs the
    first structured request most of a second on a large vocabulary; a
    caller that would rather pay at start-up calls this (lockgate's loader
    does not: the view holds 60-110 MiB for a 150k-token vocabulary). Takes
    the same arguments as `compile_json_schema`.
    """
    _llg_tokenizer(tokenizer, eos_token_ids)


def compile_json_schema(
    schema: Mapping[str, Any],
    tokenizer,
    *,
    strict: bool = False,
    eos_token_ids: Sequence[int] | None = None,
) -> Grammar:
    """Compile a JSON schema into a `Grammar` that generation must follow.

    `$defs`/`$ref` and recursive schemas work. Keywords fall in three
    classes (docs/features.md, "Which schema keywords are enforced"): those the
    grammar enforces; annotations (`title`, `description`, `default`,
    `examples`, unknown keywords), accepted and ignored; and keywords that
    change what is valid but that the grammar cannot enforce (`uniqueItems`,
    `not`, `if`, an unknown string `format`, ...). With `strict` one of the
    last class is an error naming it; otherwise (OpenAI's default) it is
    accepted, not enforced, and listed in `Grammar.unenforced`.

    :param schema: the JSON schema (a decoded JSON object).
    :param tokenizer: the model's tokenizer (its `backend_tokenizer`); its
        llguidance counterpart is cached per tokenizer object.
    :param eos_token_ids: the ids that end generation (the engine's list);
        the grammar allows them exactly when the output may end. Defaults to
        the tokenizer's EOS.
    :returns: the compiled grammar, checked by building a matcher from it.
    :raises InvalidSchema: (400, subject "schema") for an invalid or
        unsatisfiable schema, a dangling `$ref`, or anything else llguidance
        refuses; the message says what is wrong. A schema past one of the
        size and depth limits (`check_schema_limits`) is refused before
        llguidance sees it, with code `schema_too_complex`.
    """
    check_schema_limits(schema)
    llg_tokenizer = _llg_tokenizer(tokenizer, eos_token_ids)
    # native code that recurses over the client's schema: never on a thread
    # with an ordinary stack (see lockgate.native)
    return run_with_large_stack(lambda: _compile(schema, strict, llg_tokenizer))


def _compile(schema: Mapping[str, Any], strict: bool, llg_tokenizer) -> Grammar:
    layout = dict(JSON_LAYOUT, lenient=not strict)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=layout)
    except (ValueError, TypeError) as exc:
        raise _invalid(str(exc)) from exc
    return _checked(grammar, llg_tokenizer)


def compile_grammar(
    lark: str, tokenizer, *, eos_token_ids: Sequence[int] | None = None
) -> Grammar:
    """Compile an llguidance Lark grammar (a tool-call format's; JSON inside
    it written as `%json {schema}`) into a `Grammar`.

    :raises InvalidSchema: (subject "schema") when it does not compile or
        admits nothing.
    """
    llg_tokenizer = _llg_tokenizer(tokenizer, eos_token_ids)
    try:
        grammar = llguidance.grammar_from("lark", lark)
    except (ValueError, TypeError) as exc:
        raise _invalid(str(exc)) from exc
    return run_with_large_stack(lambda: _checked(grammar, llg_tokenizer))


#: what each kind of `OutputFormat` is called in error messages, and its
#: name for `llguidance.grammar_from` ("grammar" reads GBNF and Lark alike)
_TEXT_GRAMMARS = {"regex": "regular expression", "choice": "choice", "grammar": "grammar"}


def compile_text_grammar(
    kind: str, source: str, tokenizer, *, eos_token_ids: Sequence[int] | None = None
) -> Grammar:
    """Compile a regular expression (`kind` "regex"), a choice (a JSON array
    of strings) or a GBNF or Lark grammar ("grammar") into a `Grammar`.

    :raises InvalidSchema: (subject "schema") when it does not compile or
        admits nothing; the message says what is wrong.
    """
    what = _TEXT_GRAMMARS[kind]
    llg_tokenizer = _llg_tokenizer(tokenizer, eos_token_ids)

    def build() -> Grammar:
        try:
            grammar = llguidance.grammar_from(kind, source)
        except (ValueError, TypeError) as exc:
            raise _invalid(str(exc), what) from exc
        compiled = _checked(grammar, llg_tokenizer, what)
        _walk(compiled, what)
        return compiled

    # the grammar converter and compiler recurse over the client's text
    return run_with_large_stack(build)


def rebuild_grammar(
    source: str, tokenizer, *, eos_token_ids: Sequence[int] | None = None
) -> Grammar:
    """A `Grammar` from the `source` of one compiled for the same model
    elsewhere (the grammar text, not a schema: it was checked there)."""
    llg_tokenizer = _llg_tokenizer(tokenizer, eos_token_ids)
    return run_with_large_stack(lambda: _checked(source, llg_tokenizer))


def closed_objects(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """`schema` with every object that declares `properties` closed to other
    keys (`additionalProperties: false`) unless it says otherwise.

    JSON Schema allows undeclared keys by default, and a grammar that allows
    them lets a small model invent keys (`{"name": ..., "age": 28,
    "gemma_penoff": ...}`); xgrammar (vLLM, SGLang) and llama.cpp's server
    close objects the same way. `additionalProperties: true` (or a schema)
    opts back in. Members of an `allOf` stay open: closing each would
    refuse the keys the others declare.
    """
    def close(node: Any, in_all_of: bool = False) -> Any:
        if isinstance(node, list):
            return [close(item) for item in node]
        if not isinstance(node, Mapping):
            return node
        closed = {}
        for key, value in node.items():
            if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
                closed[key] = {k: close(v) for k, v in value.items()} if isinstance(value, Mapping) else value
            elif key == "allOf":
                closed[key] = [close(item, in_all_of=True) for item in value] if isinstance(value, list) else value
            elif key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then",
                         "else", "contains", "additionalItems", "unevaluatedProperties", "propertyNames"):
                closed[key] = close(value)
            else:
                closed[key] = value
        if "properties" in node and "additionalProperties" not in node and not in_all_of:
            closed["additionalProperties"] = False
        return closed

    return close(schema)


def _checked(grammar: str, llg_tokenizer, what: str = "JSON schema") -> Grammar:
    # Building a matcher compiles the grammar for real (types, $ref targets,
    # regexes, satisfiability), which building its text does not.
    template = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0, limits=_LIMITS)
    if template.is_error():
        raise _invalid(template.get_error(), what)
    compiled = Grammar(
        template,
        llg_tokenizer.vocab_size,
        frozenset(llg_tokenizer.eos_tokens),
        tuple(template.get_grammar_warnings()),
        grammar,
    )
    # Some schemas only fail at the first step (a `$ref` cycle that never
    # reaches a value); take that step now so they fail here, as a 400.
    nothing = "the schema admits no JSON value" if what == "JSON schema" else f"the {what} admits no output"
    try:
        first = compiled.matcher().allowed(compiled.vocab_size)
    except MatcherError as exc:
        raise _invalid(f"{nothing} ({exc.reason})", what) from exc
    if not first.any():
        raise _invalid(nothing, what)
    return compiled


#: steps of a text grammar taken at compile time (`_walk`)
_WALK_STEPS = 8


def _walk(compiled: Grammar, what: str) -> None:
    """Take a few steps of a client's regular expression or grammar, each
    time the first token it allows, so that one whose rules never end
    (`root ::= "a" root` allows an "a" and then refuses it) or whose lexer
    grows past llguidance's limits (`a{1000}{1000}`) is a 400 now, not a
    failure in the middle of generation."""
    matcher = compiled.matcher()
    for _ in range(_WALK_STEPS):
        try:
            allowed = np.flatnonzero(matcher.allowed(compiled.vocab_size))
        except MatcherError as exc:
            raise _invalid(f"the {what} is too complex to follow ({exc.reason})", what) from exc
        if not allowed.size:
            raise _invalid(f"the {what} admits no output", what)
        token = next((int(t) for t in allowed if t not in compiled.eos_token_ids), None)
        if token is None:
            return  # it may end here, and nothing else
        try:
            matcher.accept(token)
        except ValueError:
            raise _invalid(f"the {what} admits no output that ends: a rule refers to itself with no way out",
                           what) from None
        except MatcherError as exc:
            raise _invalid(f"the {what} is too complex to follow ({exc.reason})", what) from exc
        if matcher.is_finished:
            return


def _backend_json(tokenizer) -> str:
    """The tokenizer's `tokenizers` backend serialized, without padding or
    truncation (as `llguidance.hf.from_tokenizer` hands it over)."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def _llg_tokenizer(tokenizer, eos_token_ids: Sequence[int] | None) -> llguidance.LLTokenizer:
    eos = tuple(int(i) for i in eos_token_ids) if eos_token_ids else (tokenizer.eos_token_id,)
    if None in eos:
        raise ValueError("the tokenizer has no EOS token; pass eos_token_ids")
    with _tokenizers_lock:
        per_tokenizer = _tokenizers.setdefault(tokenizer, {})
        llg_tokenizer = per_tokenizer.get(eos)
        if llg_tokenizer is None:
            # Under the lock on purpose: concurrent first requests wait for
            # one build instead of each paying for their own. llguidance
            # reads the backend's serialized form, added tokens included
            llg_tokenizer = llguidance.LLTokenizer(
                _backend_json(tokenizer), eos_token=list(eos), slices=llguidance.LLTokenizer.json_slices()
            )
            per_tokenizer[eos] = llg_tokenizer
            # the build serialized the whole tokenizer: give that back
            trim_allocator()
    return llg_tokenizer



def grammar_for(request: GenerationRequest, model: Model) -> Grammar | None:
    """The grammar `request`'s output must follow on `model`, compiled now:
    its tools' where it reads tool output and the tool-call format has one
    for its `tool_choice`, otherwise its `response_format`'s; None when
    neither constrains it. Every schema it sends is compiled (each tool's
    parameters too, whether or not the grammar uses them), so a bad one is a
    400 naming its field before any byte is sent."""
    from lockgate.plugin_api.request import ChatRequest

    grammar = None
    output = request.response_format
    if output is not None:
        grammar = compile_output_format(output, model, param=request.param_for("schema"))
    if isinstance(request, ChatRequest) and request.reads_tool_output:
        grammar = _tools_grammar(request, model) or grammar
    return grammar


def compile_output_format(output: OutputFormat, model: Model, *, param: str) -> Grammar:
    """The grammar of a request's `OutputFormat`: its JSON schema, or its
    regular expression, choice or grammar; an error is a 400 naming `param`."""
    if output.kind == "json_schema":
        return compile_schema(output.schema, model.tokenizer, model.eos_token_ids, strict=output.strict, param=param)
    try:
        return compile_text_grammar(output.kind, output.source, model.tokenizer, eos_token_ids=model.eos_token_ids)
    except LockgateError as exc:
        exc.param = param
        raise


def compile_schema(schema, tokenizer, eos_token_ids: Sequence[int], *, strict: bool, param: str) -> Grammar:
    """One rule for every schema a client sends (`response_format`, each
    tool's parameters): compiled as the document it is; an error is a 400
    naming `param`; in a schema that is not strict, the keywords the
    grammar cannot enforce are accepted and named in a warning (strict, they
    are the 400)."""
    try:
        grammar = compile_json_schema(schema, tokenizer, strict=strict, eos_token_ids=eos_token_ids)
    except LockgateError as exc:
        exc.param = param
        raise
    if grammar.unenforced:
        log.warning("schema keywords accepted but not enforced", param=param, keywords=list(grammar.unenforced))
    return grammar


def _tools_grammar(request: ChatRequest, model: Model) -> Grammar | None:
    """A grammar that makes the output a call (`required`, a named tool), a
    call or an answer (`auto`, where the format can say so), or an answer in
    the format's own shape (`none` after earlier calls, where it has one).
    A call list ends: at most `model.max_tool_calls` calls, or one without
    `parallel_tool_calls`."""
    fmt = model.tool_call_format
    if fmt is None:
        raise UnsupportedParameter("this model has no tool-call format", param="tools")
    if not request.uses_tools:  # tool_choice "none" in a conversation that used tools
        lark = fmt.answer_grammar()
        return None if lark is None else compile_grammar(lark, model.tokenizer, eos_token_ids=model.eos_token_ids)
    for i, tool in enumerate(request.offered_tools):
        compile_schema(tool.parameters, model.tokenizer, model.eos_token_ids, strict=tool.strict,
                       param=request.tool_parameters_param(i))
    required = request.effective_tool_choice.forces_call
    max_calls = model.max_tool_calls if request.parallel_tool_calls else 1
    lark = fmt.grammar(request.forced_tools, required=required, max_calls=max_calls)
    if lark is None:
        return None
    try:
        return compile_grammar(lark, model.tokenizer, eos_token_ids=model.eos_token_ids)
    except InvalidSchema as exc:  # each compiled alone: it is their sum
        field = "tools" if request.tools else "functions"
        raise InvalidSchema(
            f"the {len(request.forced_tools)} tools' parameters compile one by one but not together "
            f"({exc.message}); send fewer tools or smaller schemas",
            param=field,
        ) from exc
