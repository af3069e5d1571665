"""Built-in `lockgate_tokenize`: the model's tokenizer."""

from __future__ import annotations

from lockgate.plugin_api.hookspecs import hookimpl


@hookimpl(trylast=True)
def lockgate_tokenize(prompt, request, model):
    # Special-token text in the prompt is parsed as such. A raw completion
    # prompt gets what the tokenizer adds (BOS where the model wants one).
    tokenizer = model.tokenizer
    if not request.is_chat:
        return tokenizer.encode(prompt, add_special_tokens=True)
    return encode_chat_prompt(prompt, tokenizer)


def encode_chat_prompt(prompt: str, tokenizer) -> list[int]:
    """A rendered chat prompt as llama.cpp's server tokenizes it: where the
    vocabulary adds a BOS (`add_bos_token`), one the template wrote is taken
    off the text and the BOS goes in front, so the prompt starts with exactly
    one whether or not the template wrote it (Phi-3.5's writes none). Where
    the vocabulary adds none, the template's own special tokens are all
    there is (SmolLM2's). EOS is left as the template wrote it (llama.cpp
    would also add one for a vocabulary with `add_eos_token`, which ends
    a prompt that asks for an answer; vLLM adds none to a chat prompt)."""
    if not getattr(tokenizer, "add_bos_token", False) or tokenizer.bos_token is None:
        return tokenizer.encode(prompt, add_special_tokens=False)
    body = tokenizer.encode(prompt.removeprefix(tokenizer.bos_token), add_special_tokens=False)
    return [tokenizer.bos_token_id, *body]
