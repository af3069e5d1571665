"""Built-in `lockgate_tokenize`: the model's tokenizer."""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl


@hookimpl(trylast=True)
def lockgate_tokenize(prompt, request, model):
    # A chat template writes the special tokens (BOS, turn markers) itself; a
    # raw completion prompt gets what the tokenizer adds (BOS where the model
    # wants one). Special-token text in the prompt is parsed as such.
    return model.tokenizer.encode(prompt, add_special_tokens=not request.is_chat)
