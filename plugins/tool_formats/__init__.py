"""Built-in `lockgate_register_tool_call_formats`: the tool-call formats lockgate
knows, and which one a model gets.

* `generic`: a JSON envelope, `{"tool_calls": [{"name", "arguments"}]}` or
  `{"response": "..."}`, for models whose template knows no tools (the
  default model's); llama.cpp's server does the same for such templates.
* `hermes`: `<tool_call>{"name", "arguments"}</tool_call>` (Hermes, Qwen 2+).
* `qwen3-coder`: `<tool_call>` around `<function=NAME>` and one
  `<parameter=KEY>` per argument, its value bare text (Qwen3-Coder, Qwen3.5).
* `llama3`: a bare JSON object `{"name", "parameters"}`, optionally after
  `<|python_tag|>`, several joined by `;` (Llama 3.1+ JSON tool calling).
* `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`
  (Mistral v0.3+), or `[TOOL_CALLS]name[ARGS]{...}` (newer templates).
* `gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>` (Gemma 4).

The format follows from the chat template (the markers it writes), unless
the operator names one with `--tool-call-format`; formats of other plugins
are tried first.
"""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.tool_calls import ToolCallFormat
from lockgate.plugins.tool_formats.gemma4 import Gemma4Format
from lockgate.plugins.tool_formats.json_formats import GenericFormat, HermesFormat, Llama3Format, MistralFormat
from lockgate.plugins.tool_formats.qwen3_coder import Qwen3CoderFormat

#: in the order they are tried against a template: the catch-all last
BUILT_IN_FORMATS: dict[str, type[ToolCallFormat]] = {
    f.name: f for f in (Qwen3CoderFormat, HermesFormat, MistralFormat, Llama3Format, Gemma4Format, GenericFormat)
}


def format_for_template(template: str | None) -> str:
    """The built-in format a chat template's own markers point to."""
    return next(f.name for f in BUILT_IN_FORMATS.values() if f.fits(template))


@hookimpl(trylast=True)
def lockgate_register_tool_call_formats(register) -> None:
    for fmt in BUILT_IN_FORMATS.values():
        register(fmt)
