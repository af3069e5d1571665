"""Reranking: `POST /rerank` and `/v1/rerank` (Jina's and Cohere's shape:
`query`, `documents`, `top_n`, `return_documents`) and vLLM's `POST
/v1/score` (`text_1`, `text_2`), typed once, and the scores.

A reranker here is a model whose file carries a classification head
(`cls.output.weight`, a row per label, as llama.cpp's converter writes
Qwen3-Reranker; `RankHead`), or a relevance-generation reranker named by
`--rerank-tokens` (the LM head's rows of those tokens: Qwen3-Reranker's
`yes,no` in a file converted without a head). Each (query, document) pair becomes one prompt
as llama.cpp's server builds it (`pair_token_ids`): the file's rerank
template (`tokenizer.chat_template.rerank`, `{query}` and `{document}`
replaced) or else BOS, query, EOS, SEP, document, EOS where the vocabulary
adds each. The engine pools the pair's last hidden state (rank pooling on a
causal model reads the last token, as llama.cpp's does) and the head scores
it: the first label's output, after a softmax over the labels for Qwen3, as
llama.cpp's rank pooling computes it. The pairs start with the same query, so
the prefix cache computes it once and each document forks from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from lockgate.errors import InvalidRequestError
from lockgate.plugin_api.body import param, read_fields
from lockgate.plugin_api.embeddings import MAX_INPUTS
from lockgate.plugin_api.fields import RERANK, SCORE, STRICT, FieldPolicy, check_fields
from lockgate.plugin_api.readers import boolean, integer, json_type, string

#: architectures whose rank head ends in a softmax over its labels (llama.cpp's)
SOFTMAX_HEADS = frozenset({"qwen3"})


@dataclasses.dataclass(frozen=True)
class RankHead:
    """A classification head on the final hidden state: `weight` (labels,
    hidden) and its optional `bias`, a softmax over the labels after."""

    weight: np.ndarray
    bias: np.ndarray | None = None
    softmax: bool = False
    #: the model's final logit soft-cap (Gemma), applied to LM-head rows' outputs
    softcap: float = 0.0

    def score(self, hidden: np.ndarray) -> float:
        """The relevance the head gives a pooled hidden state: its first
        label's output."""
        out = self.weight.astype(np.float64) @ np.asarray(hidden, dtype=np.float64)
        if self.bias is not None:
            out = out + self.bias
        if self.softcap:
            out = np.tanh(out / self.softcap) * self.softcap
        if self.softmax:
            out = np.exp(out - out.max())
            out = out / out.sum()
        return float(out[0])


def read_rank_head(path, metadata, tokenizer=None, tokens: tuple[str, ...] = (),
                   softcap: float = 0.0) -> RankHead | None:
    """The rank head of a GGUF file: with `tokens` (a relevance-generation
    reranker, `--rerank-tokens`), the LM head's rows of those tokens, the
    relevant one first, a softmax over them (Qwen3-Reranker's yes/no);
    else its classification head (`cls.output.weight`, with
    `cls.output.bias` where there is one); None where it has neither."""
    if metadata is None:
        return None
    names = {t.name for t in metadata.tensors}
    if not tokens and "cls.output.weight" not in names:
        return None
    import gguf

    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}

    def read(name: str, rows: list[int] | None = None) -> np.ndarray | None:
        t = by_name.get(name)
        if t is None:
            return None
        width = int(t.shape[0])
        data = t.data if rows is None else t.data[rows]  # a row of blocks per output
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        return np.asarray(data, dtype=np.float32).reshape(-1, width) if len(t.shape) > 1 else \
            np.asarray(data, dtype=np.float32).reshape(-1)

    if tokens:
        ids = [_single_token(tokenizer, token) for token in tokens]
        head = "output.weight" if "output.weight" in by_name else "token_embd.weight"
        return RankHead(read(head, ids), None, softmax=True, softcap=softcap)
    arch = metadata.fields["general.architecture"].contents()
    return RankHead(read("cls.output.weight"), read("cls.output.bias"), softmax=arch in SOFTMAX_HEADS)


def _single_token(tokenizer, token: str) -> int:
    """The id of `token`, which must be one token of the vocabulary."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        from lockgate.errors import ModelLoadError

        raise ModelLoadError(f"--rerank-tokens: {token!r} is {len(ids)} tokens of this vocabulary, not one")
    return ids[0]


def file_rerank_template(metadata) -> str | None:
    """A GGUF file's rerank template (`tokenizer.chat_template.rerank`)."""
    field = None if metadata is None else metadata.fields.get("tokenizer.chat_template.rerank")
    return None if field is None else str(field.contents())


def pair_token_ids(tokenizer, template: str | None, query: str, document: str) -> list[int]:
    """The prompt of one (query, document) pair, as llama.cpp's server
    builds it for rerank."""
    if template is not None:
        text = template.replace("{query}", query).replace("{document}", document)
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    if getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
    end = tokenizer.eos_token_id if getattr(tokenizer, "add_eos_token", False) else None
    ids += tokenizer.encode(query, add_special_tokens=False)
    if end is not None:
        ids.append(end)
    if getattr(tokenizer, "add_sep_token", False) and tokenizer.sep_token_id is not None:
        ids.append(tokenizer.sep_token_id)
    ids += tokenizer.encode(document, add_special_tokens=False)
    if end is not None:
        ids.append(end)
    return ids


def _text(value: Any, where: str) -> str:
    """A document: a string, or Cohere's and Jina's `{"text": ...}`."""
    if isinstance(value, dict) and set(value) == {"text"}:
        return string(value["text"], f"{where}.text")
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string or {{\"text\": string}}, not {json_type(value)}",
                                  param=where)
    return value


def _texts(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{where} must be a non-empty array", param=where)
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(f"{where} holds {len(value)} texts; the limit is {MAX_INPUTS}", param=where)
    return tuple(_text(item, f"{where}[{i}]") for i, item in enumerate(value))


def _one_or_many(value: Any, where: str) -> tuple[str, ...]:
    return (_text(value, where),) if not isinstance(value, list) else _texts(value, where)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RerankRequest:
    """A `/rerank` body: the documents to order by their relevance to `query`."""

    endpoint: ClassVar[str] = RERANK

    id: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    model: str = param("", string)
    query: str = param("", string, required=True)
    documents: tuple[str, ...] = param((), _texts, required=True)
    top_n: int | None = param(None, integer(1))
    return_documents: bool = param(True, boolean)

    def pairs(self) -> list[tuple[str, str]]:
        return [(self.query, document) for document in self.documents]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """A vLLM `/score` body: `text_1` against each `text_2` (one to many),
    or pair by pair (two lists of one length)."""

    endpoint: ClassVar[str] = SCORE

    id: str
    body: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    model: str = param("", string)
    text_1: tuple[str, ...] = param((), _one_or_many, required=True)
    text_2: tuple[str, ...] = param((), _one_or_many, required=True)

    def pairs(self) -> list[tuple[str, str]]:
        if len(self.text_1) == 1:
            return [(self.text_1[0], text) for text in self.text_2]
        if len(self.text_1) != len(self.text_2):
            raise InvalidRequestError(
                f"text_1 holds {len(self.text_1)} texts and text_2 {len(self.text_2)}: send one text_1, or "
                "two lists of one length", param="text_2")
        return list(zip(self.text_1, self.text_2))


def parse_rank_request(endpoint: str, body: Mapping[str, Any], *, request_id: str,
                       fields: FieldPolicy = STRICT) -> RerankRequest | ScoreRequest:
    """The typed `RERANK` or `SCORE` body, held to its field table."""
    check_fields(endpoint, body, fields)
    cls = RerankRequest if endpoint == RERANK else ScoreRequest
    return cls(id=request_id, body=body, **read_fields(cls, body))
