"""Embedding requests: `POST /v1/embeddings` (OpenAI's shape) and Ollama's
`POST /api/embed`, typed once, and the vectors they answer with.

An `EmbeddingRequest` holds only its own fields. The hooks see its inputs
as `EmbeddingPrompts`, a completions request of one prompt per input that
generates nothing: the same validate and tokenize hooks as a completion's
prompt (a string is tokenized with the model's special tokens, a BOS where
the vocabulary adds one, as llama.cpp tokenizes an embedding's input;
token ids are taken as sent), and errors that name `input`. The engine pools
each prompt's final hidden states (`Work.pooling`, the model's pooling) and
`normalized` scales the vector to unit length, as llama.cpp and vLLM do.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from lockgate.errors import InvalidRequestError, UnsupportedParameter
from lockgate.plugin_api.body import param, read_fields
from lockgate.plugin_api.fields import EMBEDDINGS, STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.readers import Prompt, integer, read_prompts, string
from lockgate.plugin_api.request import CompletionRequest

#: most inputs one request may carry (OpenAI's limit)
MAX_INPUTS = 2048
#: encoding formats, as OpenAI names them
FLOAT, BASE64 = "float", "base64"


def _encoding_format(value: Any, where: str) -> str:
    if value not in (FLOAT, BASE64):
        raise InvalidRequestError(f"{where} must be 'float' or 'base64', got {value!r}", param=where)
    return value


def embedding_inputs(value: Any, where: str) -> tuple[Prompt, ...]:
    """`input`: a string, an array of strings, an array of token ids or an
    array of token-id arrays (one input each), at most `MAX_INPUTS`."""
    if isinstance(value, list) and not value:
        raise InvalidRequestError(f"{where} must not be empty", param=where)
    inputs = read_prompts(value, where)
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(f"{where} holds {len(inputs)} inputs; the limit is {MAX_INPUTS}", param=where)
    for i, one in enumerate(inputs):
        if one == "":
            raise InvalidRequestError(f"{where} must not hold an empty string" if len(inputs) > 1
                                      else f"{where} must not be an empty string",
                                      param=where if len(inputs) == 1 else f"{where}[{i}]")
    return inputs


class EmbeddingPrompts(CompletionRequest):
    """An embedding request's inputs as the pipeline's hooks see them: a
    completions request, one prompt per input, that generates nothing; its
    errors name `input`."""

    endpoint: ClassVar[str] = EMBEDDINGS
    prompt_field: ClassVar[str] = "input"
    generates: ClassVar[bool] = False

    def _check_combinations(self) -> None:
        """Nothing to hold together: no generation field is set (and
        `max_tokens` 0 is what a pooled prompt generates)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingRequest:
    """A `POST /v1/embeddings` body (or Ollama's `/api/embed`, read into the
    same fields by `lockgate.plugin_api.ollama`)."""

    endpoint: ClassVar[str] = EMBEDDINGS

    id: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    model: str = param("", string)
    inputs: tuple[Prompt, ...] = param((), embedding_inputs, key="input", required=True)
    encoding_format: str = param(FLOAT, _encoding_format)
    dimensions: int | None = param(None, integer(1))
    #: Ollama's `truncate`: an input past the context (or `num_ctx`) is
    #: cut to it, else it is a 400
    truncate: bool = False
    #: Ollama's `options.num_ctx`: the context an input is cut to
    num_ctx: int | None = None

    def to_prompts(self) -> EmbeddingPrompts:
        """The inputs as the completions-shaped request the hooks see."""
        return EmbeddingPrompts.checked(id=self.id, body=self.body, model=self.model, prompts=self.inputs,
                                        max_tokens=0)

    def truncate_to(self, context_length: int) -> int | None:
        """The tokens an input is cut to (None: not cut; a longer one is refused)."""
        if self.num_ctx is not None and self.num_ctx > context_length:
            raise UnsupportedParameter(
                f"options.num_ctx ({self.num_ctx}) is more than this model's context of {context_length} tokens",
                param="options.num_ctx")
        return min(self.num_ctx or context_length, context_length) if self.truncate else None

    def check_dimensions(self, size: int) -> None:
        """`dimensions` may only ask for the model's own size: the families
        lockgate runs are not trained to be truncated (Matryoshka)."""
        if self.dimensions is not None and self.dimensions != size:
            raise InvalidRequestError(
                f"this model makes {size}-dimensional embeddings and cannot shorten them; "
                f"dimensions must be {size} or left out",
                param="dimensions",
            )


def parse_embedding_request(body: Mapping[str, Any], *, request_id: str,
                            fields: FieldPolicy = STRICT) -> EmbeddingRequest:
    """The typed embeddings request of `body`, held to its field table."""
    check_fields(EMBEDDINGS, body, fields)
    return EmbeddingRequest(id=request_id, body=body, **read_fields(EmbeddingRequest, body))


def normalized(vector: np.ndarray) -> np.ndarray:
    """`vector` scaled to unit L2 length (a zero vector stays zero)."""
    vector = np.asarray(vector, dtype=np.float32)
    length = float(np.linalg.norm(vector.astype(np.float64)))
    return vector if length == 0.0 else (vector / length).astype(np.float32)


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """The vector as OpenAI's answer carries it: a list of floats, or the
    base64 of its little-endian float32 bytes."""
    if encoding_format == BASE64:
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in np.asarray(vector, dtype=np.float32)]
