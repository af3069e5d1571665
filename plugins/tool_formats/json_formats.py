"""The tool-call formats whose calls are JSON: `generic` (an envelope),
`hermes` (`<tool_call>` tags), `llama3` (a bare object) and `mistral`
(`[TOOL_CALLS]`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import string

from lockgate.plugin_api.tool_calls import (
    CALL,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    arguments_text,
    calls_grammar,
    lark_json,
    lark_string,
    repeated,
)
from lockgate.plugins.tool_formats.common import calls_from, complete_items, parse_json, tool_list


_CALLS_OPENING = '{"tool_calls": ['
_ANSWER_OPENING = '{"response": "'


def _opens_envelope(text: str) -> bool:
    """Whether `text` is the generic envelope cut short: a start of either
    opening, or calls none of which was written out whole."""
    text = text.strip()
    return bool(text) and any(
        opening.startswith(text) or text.startswith(opening) for opening in (_CALLS_OPENING, _ANSWER_OPENING)
    )


def _string_prefix(text: str, opening: str) -> str | None:
    """The text of a JSON string that `text` opens with `opening`, as far as
    it was written before the text ends."""
    text = text.strip()
    if not text.startswith(opening):
        return None
    rest = text[len(opening):]
    for end in range(len(rest), max(len(rest) - 8, -1), -1):  # an escape may be cut in half
        try:
            return json.loads('"' + rest[:end] + '"')
        except ValueError:
            continue
    return None


class GenericFormat(ToolCallFormat):
    name = "generic"

    @classmethod
    def fits(cls, chat_template):
        return True  # the catch-all, registered last

    def instructions(self, tools):
        return (
            "You can call these tools (each with a JSON schema of its arguments):\n"
            f"{tool_list(tools)}\n"
            'Answer with one JSON object: {"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} '
            'to call tools, or {"response": "<your answer>"} to answer directly. Once the tool results '
            'you need are in the conversation, answer with {"response": "..."}.'
        )

    def render_calls(self, calls):
        return json.dumps(
            {"tool_calls": [{"name": c.name, "arguments": parse_json(c.arguments) or {}} for c in calls]},
            ensure_ascii=False,
        )

    def grammar(self, tools, *, required, max_calls):
        # "{" a lexeme of its own: the answer's `%json` opens with one too, and
        # llguidance's lexer does not back off a longer literal it has begun
        envelope = (lark_string("{"), lark_string(_CALLS_OPENING[1:]), repeated(CALL, ", ", max_calls),
                    lark_string("]}"))
        calls = " ".join(envelope)
        return calls_grammar(calls if required else f"({calls}) | {lark_json(self._ANSWER)}", tools)

    _ANSWER = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
               "additionalProperties": False}

    def answer_grammar(self):
        # the conversation's earlier turns are envelopes: so is this answer
        return "start: " + lark_json(self._ANSWER)

    def parse(self, text):
        obj = parse_json(text.strip())
        if obj is None:  # cut short (max_tokens): the calls written out whole still count
            calls = calls_from(complete_items(text, _CALLS_OPENING))
            if calls:
                return ParsedOutput(None, calls)
            answer = _string_prefix(text, _ANSWER_OPENING)
            if answer is not None:  # and an answer cut short is still the answer
                return ParsedOutput(answer or None, [])
            if _opens_envelope(text):  # cut before a call or an answer was whole: neither
                return ParsedOutput(None, [])
        if isinstance(obj, dict):
            if isinstance(obj.get("tool_calls"), list):
                calls = calls_from(obj["tool_calls"])
                if calls is not None:
                    return ParsedOutput(None, calls)
            if isinstance(obj.get("tool_call"), dict):  # one call, as some models write it
                calls = calls_from([obj["tool_call"]])
                if calls is not None:
                    return ParsedOutput(None, calls)
            if isinstance(obj.get("response"), str):
                return ParsedOutput(obj["response"], [])
        return ParsedOutput(text or None, [])


class HermesFormat(ToolCallFormat):
    name = "hermes"

    @classmethod
    def fits(cls, chat_template):
        return "<tool_call>" in (chat_template or "")
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def instructions(self, tools):
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tool_list(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_calls(self, calls):
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c.name, "arguments": parse_json(c.arguments) or {}}) + "\n</tool_call>"
            for c in calls
        )

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        tagged = " ".join((lark_string("<tool_call>\n"), CALL, lark_string("\n</tool_call>")))
        return calls_grammar(repeated(tagged, "\n", max_calls), tools)

    def parse(self, text):
        calls, spans = [], []
        for match in self._CALL.finditer(text):
            found = calls_from([parse_json(match[1])])
            if found is None:
                continue
            calls += found
            spans.append(match.span())
        content = text
        for start, end in reversed(spans):
            content = content[:start] + content[end:]
        return ParsedOutput(content.strip() or None, calls)

    def start_markers(self):
        return ("<tool_call>",)


class Llama3Format(ToolCallFormat):
    name = "llama3"

    @classmethod
    def fits(cls, chat_template):
        template = chat_template or ""
        return "<|python_tag|>" in template or "ipython" in template
    keeps_special_tokens = True
    _TAG = "<|python_tag|>"

    def instructions(self, tools):
        return (
            "Given the following functions, please respond with a JSON for a function call with its "
            "proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name '
            "and its value}. Do not use variables.\n\n" + tool_list(tools)
        )

    def render_calls(self, calls):
        return "; ".join(json.dumps({"name": c.name, "parameters": parse_json(c.arguments) or {}}) for c in calls)

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        return calls_grammar(repeated(CALL, "; ", max_calls), tools, arguments_key="parameters")

    def parse(self, text):
        body = text.strip().removeprefix(self._TAG).strip()
        if body.startswith("{"):
            decoded = parse_json(body)
            objects = [decoded] if decoded is not None else [parse_json(part) for part in body.split(";")]
            calls = calls_from(objects, "parameters")
            if calls:
                return ParsedOutput(None, calls)
        return ParsedOutput(text or None, [])

    def leading_markers(self):
        return (self._TAG, "{")


class MistralFormat(ToolCallFormat):
    name = "mistral"

    @classmethod
    def fits(cls, chat_template):
        return "[TOOL_CALLS]" in (chat_template or "")
    keeps_special_tokens = True
    _TAG = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_-]+)\s*\[ARGS\]\s*(\{.*?\})(?=\s*\[TOOL_CALLS\]|\s*$)", re.S)

    def instructions(self, tools):
        return (
            f"You can call these tools (each with a JSON schema of its arguments):\n{tool_list(tools)}\n"
            f'To call tools, answer with {self._TAG} then a JSON array of {{"name": ..., "arguments": {{...}}}}.'
        )

    def render_calls(self, calls):
        return self._TAG + json.dumps([{"name": c.name, "arguments": parse_json(c.arguments) or {}} for c in calls])

    def grammar(self, tools, *, required, max_calls):
        if not required:
            return None
        return calls_grammar(" ".join((lark_string("["), repeated(CALL, ", ", max_calls), lark_string("]"))), tools)

    def parse(self, text):
        body = text.strip()
        named = self._NAMED.findall(body)
        if named:
            return ParsedOutput(None, [
                ToolCall(name, arguments_text(parse_json(args) or {}), id=self.new_call_id()) for name, args in named
            ])
        head, tag, rest = body.partition(self._TAG)
        candidate = rest if tag else body
        decoded = parse_json(candidate.strip())
        if isinstance(decoded, list) and decoded:
            calls = calls_from(decoded)
            if calls is not None:
                # Nemo's template writes each call's id after it: a model
                # that writes one in the right shape keeps it
                ids = [item.get("id") for item in decoded]
                return ParsedOutput(head.strip() or None, [
                    dataclasses.replace(call, id=i if _is_mistral_id(i) else self.new_call_id())
                    for call, i in zip(calls, ids)
                ])
        return ParsedOutput(text or None, [])

    def start_markers(self):
        return (self._TAG,)

    def leading_markers(self):
        return ("[",)

    def new_call_id(self):
        # Mistral's templates refuse an id that is not 9 letters and digits
        # ("Tool call IDs should be alphanumeric strings with length 9!"),
        # as Mistral's API does; vLLM makes them so for these models too
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))

    def template_call_id(self, call_id):
        """An id of another shape (another server's, or lockgate's own from
        before) as 9 letters and digits from its hash: the same id maps the
        same way in the call and in its result, and in every later request
        of the conversation (vLLM keeps the last 9 characters, which two
        ids can share)."""
        if _is_mistral_id(call_id):
            return call_id
        number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        digits = []
        for _ in range(_ID_LENGTH):
            number, digit = divmod(number, len(_ID_ALPHABET))
            digits.append(_ID_ALPHABET[digit])
        return "".join(digits)


_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 9


def _is_mistral_id(value) -> bool:
    return isinstance(value, str) and len(value) == _ID_LENGTH and all(c in _ID_ALPHABET for c in value)


# --- Qwen3-Coder's XML calls ------------------------------------------------------------------

#: one parameter's closing, which its text value runs up to
