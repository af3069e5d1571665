"""What a client is told when its schema, regular expression or grammar
does not compile: a sentence from llguidance's account of it, the client's
own text quoted briefly, never the grammar lockgate built around it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from lockgate.engine.structured import _unenforced_keywords
from lockgate.errors import InvalidSchema
from lockgate.plugin_api.schema_limits import SUBJECT

_MAX_LINE = 160
_MAX_LINES = 8


def invalid(reason: str, what: str = "JSON schema") -> InvalidSchema:
    """A 400 that says in a sentence what is wrong with the client's
    schema (or regular expression, or grammar: `what`), from llguidance's
    account of it."""
    return InvalidSchema(_explained(reason, what), subject=SUBJECT)


def _explained(reason: str, what: str = "JSON schema") -> str:
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
    if reason.startswith("the ") and ("admits no" in reason or "too complex" in reason):
        return reason
    return f"invalid {what}: " + "\n".join(lines[:_MAX_LINES])


#: where llguidance's account of a grammar error begins, after its position
#: and "failed to compile JSON schema" (and before any grammar text)
_COMPILER_PREFIX = re.compile(r"^(?:at \d+\(\d+\): )?(?:failed to compile JSON schema: )?")
_DANGLING = re.compile(r"Pointer '([^']*)' does not exist")
_REMOTE = re.compile(r"Resource '([^']*)' is not present in a registry")


def _compiler_message(reason: str) -> str:
    # the first line is llguidance's account; the lines after it, where a
    # grammar failed, quote the grammar text, which is ours, not the client's
    lines = reason.strip().splitlines() or [""]
    first = _COMPILER_PREFIX.sub("", lines[0])
    if first.startswith("regex parse error"):
        return "\n".join([first, *lines[1:]])
    if first.endswith("regex parse error:"):
        # a client's regular expression: the regex crate's reason, without
        # the grammar lockgate wrapped it in
        detail = next((line.strip() for line in lines[1:] if line.strip().startswith("error:")), "")
        return f"{first} {detail.removeprefix('error:').strip()}".rstrip()
    return first


def _listed(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
