"""Bounds on a client's JSON schema, checked in Python before llguidance's
compiler sees it (`grammars.compile_json_schema` calls
`check_schema_limits`): its size, its nesting, and its nesting with every
`$ref` followed, each walked iteratively and linear in the schema's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from lockgate.errors import InvalidSchema

#: what schema errors are about; the request says which field held the schema
SUBJECT = "schema"

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


def _too_complex(message: str) -> InvalidSchema:
    return InvalidSchema(message, subject=SUBJECT, code="schema_too_complex")


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
