"""Built-in `lockgate_register_reasoning_formats`: the ways of writing
thinking lockgate knows, and which one a model gets.

* `deepseek_r1`: `<think>...</think>` before the answer (DeepSeek-R1 and its
  distills, DeepSeek V3.1+). Such a model always thinks: where its template
  opens neither tag (R1's first templates) the output starts inside the
  thinking, and where the prompt ends with `</think>` (V3.1 with thinking
  off) it does not.
* `qwen3`: `<think>...</think>` (Qwen3, QwQ, Qwen3.5, and any template that
  writes the tags): the model opens the tag itself, or the prompt does (QwQ,
  Qwen3 thinking models); `chat_template_kwargs: {"enable_thinking": false}`
  makes Qwen3's template close it in the prompt, so the answer is all text.

The format follows from the chat template, unless the operator names one
with `--reasoning-format` (`none`: the thinking stays in the answer's
text); formats of other plugins are tried first.
"""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl
from lockgate.plugin_api.reasoning import ReasoningFormat


class DeepSeekR1Format(ReasoningFormat):
    name = "deepseek_r1"
    always_thinks = True

    @classmethod
    def fits(cls, chat_template: str | None) -> bool:
        return "<｜Assistant｜>" in (chat_template or "") and "</think>" in (chat_template or "")


class Qwen3Format(ReasoningFormat):
    name = "qwen3"

    @classmethod
    def fits(cls, chat_template: str | None) -> bool:
        return "<think>" in (chat_template or "") and "</think>" in (chat_template or "")


#: in the order they are tried against a template
BUILT_IN_FORMATS: dict[str, type[ReasoningFormat]] = {f.name: f for f in (DeepSeekR1Format, Qwen3Format)}


@hookimpl(trylast=True)
def lockgate_register_reasoning_formats(register) -> None:
    for fmt in BUILT_IN_FORMATS.values():
        register(fmt)
