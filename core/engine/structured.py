"""Structured output: a JSON schema compiled into an llguidance grammar, and
the per-sequence matchers that say which tokens may come next.

`compile_json_schema` runs in the request pipeline, before any response byte
is sent, so every problem with the schema becomes a 400 (`InvalidSchema`)
rather than a failure mid-stream. The engine then asks `Grammar.matcher()`
for one `Matcher` per generated sequence and, at every step, masks that
sequence's logits row with `Matcher.allowed`, samples, and feeds the token
back through `Matcher.accept`.

JSON is generated on one line with a space after `,` and `:`
(`{"a": 1, "b": [1, 2]}`, Python's `json.dumps` layout). JSON allows any
whitespace there, but free whitespace lets a small model loop on newlines
until max_tokens; a schema can still choose its own layout through
llguidance's top-level `"x-guidance"` key.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote

import llguidance
import llguidance.numpy
import numpy as np

from lockgate.errors import InvalidSchema
from lockgate.native import run_with_large_stack

__all__ = [
    "Grammar",
    "Matcher",
    "MAX_SCHEMA_EXPANDED_DEPTH",
    "MAX_SCHEMA_NESTING",
    "MAX_SCHEMA_NODES",
    "MatcherError",
    "check_schema_limits",
    "closed_objects",
    "compile_grammar",
    "compile_json_schema",
    "prepare_tokenizer",
    "rebuild_grammar",
]

#: what schema errors are about; the request says which field held the schema
_SUBJECT = "schema"

# Applied before the schema's own "x-guidance" options, so a schema may
# override them.
#: how generated JSON is laid out (see the module docstring)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Error texts without the parser state and the whole grammar appended: the
# message goes back to the client, which already has its schema.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_MAX_LINE = 160
_MAX_LINES = 8

# Bounds on what reaches llguidance, checked in Python first. Its compiler
# recurses once per level it expands, following `$ref` into the target, with
# several KiB of native stack a level: a 3,000-long `$ref` chain overflowed an
# 8 MiB stack and killed the process. Real schemas stay far below these
# (OpenAI's own structured outputs allow 10 levels of nesting and 5,000
# properties); llguidance itself refuses a schema document nested over 128
# JSON levels, and the compile runs on a large-stack thread as well.
#: JSON objects and arrays nested in the schema document itself
MAX_SCHEMA_NESTING = 128
#: JSON objects and arrays nested along any path, each `$ref` counting as
#: nesting its target there (recursive references stop at the cycle)
MAX_SCHEMA_EXPANDED_DEPTH = 256
#: JSON objects and arrays in the schema document
MAX_SCHEMA_NODES = 20_000

# tokenizer -> {eos ids -> LLTokenizer}. Building an LLTokenizer walks the
# whole vocabulary (most of a second for 49k tokens), so it is done once per
# tokenizer object; weak keys let an unloaded model's tokenizer go.
_tokenizers: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_tokenizers_lock = threading.Lock()


class MatcherError(RuntimeError):
    """The matcher cannot go on (llguidance hit one of its parser limits).

    Not the client's fault and not a bad schema: the sequence it belongs to
    has to be failed.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"structured output failed: {reason}")
        #: llguidance's own account
        self.reason = reason


def prepare_tokenizer(tokenizer, *, eos_token_ids: Sequence[int] | None = None) -> None:
    """Build and cache llguidance's view of `tokenizer` now.

    Optional: `compile_json_schema` builds it on first use, but that
    costs the first structured request most of a second, which a model
    loader can pay at start-up instead. Takes the same arguments as
    `compile_json_schema`.
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
    :param tokenizer: the model's transformers fast tokenizer; its
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


def check_schema_limits(schema: Mapping[str, Any]) -> None:
    """Refuse a schema larger or deeper than the compiler is allowed to see.

    :raises InvalidSchema: (400, code `schema_too_complex`) naming the limit:
        `MAX_SCHEMA_NODES`, `MAX_SCHEMA_NESTING` or
        `MAX_SCHEMA_EXPANDED_DEPTH`.
    """
    nodes, nesting = _count_and_nesting(schema)
    if nodes > MAX_SCHEMA_NODES:
        raise _too_complex(
            f"the schema has {nodes} JSON objects and arrays; "
            f"the limit is {MAX_SCHEMA_NODES}"
        )
    if nesting > MAX_SCHEMA_NESTING:
        raise _too_complex(
            f"the schema nests {nesting} JSON objects and arrays deep; "
            f"the limit is {MAX_SCHEMA_NESTING}"
        )
    depth = _expanded_depth(schema, MAX_SCHEMA_EXPANDED_DEPTH)
    if depth > MAX_SCHEMA_EXPANDED_DEPTH:
        raise _too_complex(
            "the schema nests more than "
            f"{MAX_SCHEMA_EXPANDED_DEPTH} levels deep when its $ref chains are followed "
            f"(each $ref nests its target); the limit is {MAX_SCHEMA_EXPANDED_DEPTH}"
        )


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


def _checked(grammar: str, llg_tokenizer) -> Grammar:
    # Building a matcher compiles the grammar for real (types, $ref targets,
    # regexes, satisfiability), which building its text does not.
    template = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0, limits=_LIMITS)
    if template.is_error():
        raise _invalid(template.get_error())
    compiled = Grammar(
        template,
        llg_tokenizer.vocab_size,
        frozenset(llg_tokenizer.eos_tokens),
        tuple(template.get_grammar_warnings()),
        grammar,
    )
    # Some schemas only fail at the first step (a `$ref` cycle that never
    # reaches a value); take that step now so they fail here, as a 400.
    try:
        first = compiled.matcher().allowed(compiled.vocab_size)
    except MatcherError as exc:
        raise _invalid(f"the schema admits no JSON value ({exc.reason})") from exc
    if not first.any():
        raise _invalid("the schema admits no JSON value")
    return compiled


class Grammar:
    """A compiled `response_format`: immutable, shared by every choice of a
    request. Each generated sequence gets its own `matcher()`."""

    __slots__ = ("_eos_token_ids", "_source", "_template", "_vocab_size", "_warnings")

    def __init__(
        self,
        template: llguidance.LLMatcher,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        warnings: tuple[str, ...],
        source: str,
    ) -> None:
        # never advanced: only copied, so it stays at the start of the grammar
        self._template = template
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._warnings = warnings
        self._source = source

    @property
    def source(self) -> str:
        """The llguidance grammar text this was compiled from: what another
        process (a Ray replica) rebuilds it from with `rebuild_grammar`."""
        return self._source

    @property
    def vocab_size(self) -> int:
        """How many token ids the grammar knows; higher ids are never allowed."""
        return self._vocab_size

    @property
    def warnings(self) -> tuple[str, ...]:
        """What llguidance ignored in a non-strict schema, in its words."""
        return self._warnings

    @property
    def unenforced(self) -> tuple[str, ...]:
        """The keywords of a non-strict schema that change what is valid but
        that generation does not enforce (`'uniqueItems'`, `the string
        format 'binary'`): the warning the request's log line gives."""
        return tuple(k for w in self._warnings for k in (_unenforced_keywords(w) or [w]))

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar, for one sequence."""
        # a copy shares the compiled grammar, so this costs microseconds
        return Matcher(self._template.deep_copy(), self._vocab_size, self._eos_token_ids)


class Matcher:
    """Where one generated sequence stands in its grammar.

    Per decode step: `allowed(width)`, mask
    the logits, sample, `accept(token)`; stop with finish_reason "stop"
    once `is_finished`. Not thread-safe: one sequence, one thread.
    """

    __slots__ = ("_eos_token_ids", "_matcher", "_vocab_size", "_words")

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        # llguidance writes one bit per token into 32-bit words; reused each step
        self._words = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def allowed(self, width: int) -> np.ndarray:
        """Which of `width` token ids may come next, as a bool array.

        `width` is the logits row's length, which may exceed the
        tokenizer's vocabulary (padding): those extra ids are never allowed.
        An EOS id is allowed exactly when the output may end here.

        :raises MatcherError: the matcher hit an llguidance limit.
        """
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._words)
        self._check()
        mask = np.empty(width, dtype=bool)
        _unpack_into(self._words[0], self._vocab_size, mask)
        return mask

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token.

        :raises ValueError: the token was not allowed here; the matcher is
            left as it was.
        """
        token_id = int(token_id)
        if self._matcher.is_stopped():
            # Complete output: llguidance's mask offers EOS, but its
            # try_consume_tokens refuses it, so check against the EOS ids.
            allowed = token_id in self._eos_token_ids and not self._matcher.is_error()
        else:
            # try_consume_tokens, unlike consume_token, leaves the matcher
            # usable when it refuses a token
            allowed = 0 <= token_id < self._vocab_size and (
                self._matcher.try_consume_tokens([token_id]) == 1
            )
        if not allowed:
            raise ValueError(f"token {token_id} is not allowed by the grammar here")

    @property
    def is_accepting(self) -> bool:
        """The output so far is complete: it may end here (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        """The output is complete and nothing but EOS can follow: stop now."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on, or None."""
        return self._matcher.get_error() or None

    def _check(self) -> None:
        if self._matcher.is_error():
            raise MatcherError(_first_line(self._matcher.get_error()))


def _unpack_into(words: np.ndarray, vocab_size: int, mask_row: np.ndarray) -> None:
    # Bit j of word k is token 32*k + j. Read as bytes on a little-endian
    # host, that is numpy's little bit order.
    known = min(vocab_size, mask_row.shape[0])
    bits = np.unpackbits(words.view(np.uint8), count=known, bitorder="little")
    mask_row[:known] = bits.view(bool)
    mask_row[known:] = False


def _too_complex(message: str) -> InvalidSchema:
    return InvalidSchema(message, subject=_SUBJECT, code="schema_too_complex")


def _children(node) -> list:
    values = node.values() if isinstance(node, Mapping) else node
    return [v for v in values if isinstance(v, (Mapping, list))]


def _count_and_nesting(root) -> tuple[int, int]:
    """JSON objects and arrays in `root`, and how deep they nest (iterative:
    the document may be nested deeper than Python's recursion limit)."""
    count, deepest = 0, 0
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in _children(node))
    return count, deepest


def _resolve_ref(root, ref: str):
    """The node a local JSON pointer (`#`, `#/$defs/a~1b`) names, or None
    (remote and dangling references are llguidance's to report)."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer == "":
        return root
    if not pointer.startswith("/"):
        return None
    node = root
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping):
            node = node.get(token)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node if isinstance(node, (Mapping, list)) else None


def _expanded_depth(root, limit: int) -> int:
    """How deep `root` nests with each `$ref` nesting its target in its
    place; a reference back into the path being expanded (recursion) adds
    nothing. Stops counting once past `limit`.

    Depth-first with each node's depth kept once known, so shared
    definitions are expanded once: linear in the document's size.
    """
    known: dict[int, int] = {}
    on_path: set[int] = set()

    def edges(node) -> list:
        children = _children(node)
        if isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
            target = _resolve_ref(root, node["$ref"])
            if target is not None:
                children.append(target)
        return children

    # frames: [node, its remaining edges, deepest child so far]
    path = [[root, iter(edges(root)), 0]]
    on_path.add(id(root))
    while path:
        if len(path) > limit:
            return len(path)
        frame = path[-1]
        child = next(frame[1], None)
        if child is None:
            node, _, deepest = path.pop()
            on_path.discard(id(node))
            known[id(node)] = deepest + 1
            if path:
                path[-1][2] = max(path[-1][2], deepest + 1)
        elif id(child) in known:
            frame[2] = max(frame[2], known[id(child)])
        elif id(child) not in on_path:
            on_path.add(id(child))
            path.append([child, iter(edges(child)), 0])
    return known[id(root)]


def _invalid(reason: str) -> InvalidSchema:
    """A 400 that says in a sentence what is wrong with the client's
    schema, from llguidance's account of it."""
    return InvalidSchema(_explained(reason), subject=_SUBJECT)


def _explained(reason: str) -> str:
    reason = _compiler_message(reason)
    keywords = _unenforced_keywords(reason)
    if keywords:
        it = "it" if len(keywords) == 1 else "them"
        return (
            f"the schema uses {_listed(keywords)}, which lockgate cannot enforce while generating, and a "
            f"strict schema may only use keywords that are enforced (remove {it}, or leave strict off to "
            f"have {it} accepted and not enforced)"
        )
    pointer = _DANGLING.search(reason)
    if pointer:
        return f"the $ref '#{pointer[1]}' points at nothing in this schema (no '{pointer[1]}' in it)"
    remote = _REMOTE.search(reason)
    if remote:
        return (
            f"the $ref '{remote[1]}' names a schema outside this one, which lockgate does not fetch; "
            "put it under $defs and refer to it as '#/$defs/...'"
        )
    # llguidance quotes the offending part of the schema, which may be huge,
    # on its own line (a regex error puts the reason after the pattern):
    # shorten long lines rather than cut the end off.
    lines = [
        line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 1] + "…"
        for line in reason.splitlines()
    ]
    return "invalid JSON schema: " + "\n".join(lines[:_MAX_LINES])


#: where llguidance's account of a grammar error begins, after its position
#: and "failed to compile JSON schema" (and before any grammar text)
_COMPILER_PREFIX = re.compile(r"^(?:at \d+\(\d+\): )?(?:failed to compile JSON schema: )?")
_DANGLING = re.compile(r"Pointer '([^']*)' does not exist")
_REMOTE = re.compile(r"Resource '([^']*)' is not present in a registry")
#: llguidance's words for a keyword it does not implement (a warning when
#: lenient, the error when strict), and what the client wrote
_UNENFORCED = (
    (re.compile(r"Unimplemented keys: \[([^\]]*)\]"), lambda m: [f"'{k}'" for k in json.loads(f"[{m[1]}]")]),
    (re.compile(r"Unknown format: (.*)"), lambda m: [f"the string format '{m[1].strip()}'"]),
    (re.compile(r"oneOf constraints are not supported"), lambda m: ["'oneOf' with branches that may overlap"]),
    (re.compile(r"min/maxProperties only supported when"),
     lambda m: ["'minProperties'/'maxProperties' on an object whose properties are not all required"]),
)


def _compiler_message(reason: str) -> str:
    # the first line is llguidance's account; the lines after it, where a
    # grammar failed, quote the grammar text, which is ours, not the client's
    lines = reason.strip().splitlines() or [""]
    first = _COMPILER_PREFIX.sub("", lines[0])
    if first.startswith("regex parse error"):
        return "\n".join([first, *lines[1:]])
    return first


def _unenforced_keywords(message: str) -> list[str]:
    """The keywords a message of llguidance's names as not enforced."""
    for pattern, named in _UNENFORCED:
        match = pattern.search(message)
        if match:
            try:
                return named(match)
            except ValueError:
                return [match[0]]
    return []


def _listed(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _first_line(text: str) -> str:
    # non-verbose llguidance errors still end in a "<non-verbose/>" line
    return text.strip().splitlines()[0] if text.strip() else text


def _llg_tokenizer(tokenizer, eos_token_ids: Sequence[int] | None) -> llguidance.LLTokenizer:
    eos = tuple(int(i) for i in eos_token_ids) if eos_token_ids else (tokenizer.eos_token_id,)
    if None in eos:
        raise ValueError("the tokenizer has no EOS token; pass eos_token_ids")
    with _tokenizers_lock:
        per_tokenizer = _tokenizers.setdefault(tokenizer, {})
        llg_tokenizer = per_tokenizer.get(eos)
        if llg_tokenizer is None:
            # Under the lock on purpose: concurrent first requests wait for
            # one build instead of each paying for their own. Imported here:
            # it imports transformers (22 MiB resident, over a second), which a
            # process that never builds a grammar tokenizer does without.
            import llguidance.hf

            llg_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer,
                eos_token=list(eos),
                slices=llguidance.LLTokenizer.json_slices(),
            )
            per_tokenizer[eos] = llg_tokenizer
    return llg_tokenizer

