"""Record llama.cpp's embeddings of a few texts on tiny models: the
reference `tests/e2e/test_embeddings.py` checks `/v1/embeddings` against.

Run with a Python that has llama-cpp-python 0.3.36 (built once from its
sdist, see record_family_goldens.py) and gguf:

    python tests/data/record_embedding_goldens.py [OUT.json]

For each case it writes the tiny GGUF with `tests/support/tiny_model.py`
and asks `Llama(embedding=True, pooling_type=...)` for each text's
embedding, normalized (`embed(normalize=True)`, llama.cpp's L2 norm), and
the tokens llama.cpp made of it. The file's sha256 is recorded so a changed
writer is caught rather than compared.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "support"))

from tiny_model import write_tiny_gguf  # noqa: E402

#: name: (writer overrides, pooling)
CASES = {
    "llama-mean": ({}, "mean"),
    "llama-last": ({}, "last"),
    "qwen2-cls": ({"architecture": "qwen2", "attention_bias": True}, "cls"),
    "qwen3-last": ({"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0}, "last"),
    "gemma3-mean": ({
        "architecture": "gemma3", "qk_norm": True, "head_dim": 32, "num_layers": 4, "sliding_window": 8,
        "sliding_window_pattern": 2, "rope_local_theta": 10000.0, "rope_theta": 1000000.0,
        "final_logit_softcap": 30.0,
    }, "mean"),
}

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "lockgate pools the final hidden states of every token of this longer input, which spans a page or two "
    "of the KV cache and a window of the sliding layers",
]

#: rerankers: Qwen3 with a two-label classification head, with the file's
#: rerank template and without; name: (writer overrides, [(query, documents)])
QWEN3 = {"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0,
         "classifier_labels": ["yes", "no"]}
RERANK_TEMPLATE = "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
RERANK_CASES = {
    "qwen3-rerank-template": dict(QWEN3, rerank_template=RERANK_TEMPLATE),
    "qwen3-rerank-plain": QWEN3,
    # a relevance-generation reranker: no head, the logits of two tokens
    # (`--rerank-tokens`; Qwen3-Reranker's are yes,no, which the tiny
    # vocabulary spells in more than one token)
    "qwen3-rerank-tokens": {k: v for k, v in QWEN3.items() if k != "classifier_labels"},
}
#: the scoring tokens of a relevance-generation case, the relevant one first
RERANK_TOKENS = {"qwen3-rerank-tokens": ("a", "b")}
QUERY = "what do cats eat?"
DOCUMENTS = ["Cats eat fish and meat.", "The stock market fell today.", "a", "Kittens drink milk, cats eat mice."]

TENSOR_TYPE = "F16"
SEED = 5


def write_case(directory: pathlib.Path, name: str) -> pathlib.Path:
    overrides = RERANK_CASES[name] if name in RERANK_CASES else CASES[name][0]
    return write_tiny_gguf(directory / f"{name}.gguf", tensor_type=TENSOR_TYPE, seed=SEED, **overrides)


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(name: str, path: pathlib.Path) -> dict:
    import llama_cpp

    pooling = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
               "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}[CASES[name][1]]
    llm = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=pooling, n_ctx=512, n_batch=512,
                          n_ubatch=512, n_threads=2, verbose=False)
    return {
        "sha256": sha256(path),
        "pooling": CASES[name][1],
        "tokens": [llm.tokenize(text.encode()) for text in TEXTS],
        "embeddings": [llm.embed(text, normalize=True) for text in TEXTS],
    }


def record_rerank(name: str, path: pathlib.Path) -> dict:
    """Each (QUERY, document) pair's prompt as llama.cpp's server builds it
    (format_prompt_rerank: the file's rerank template with special tokens
    parsed, else the query's and the document's tokens with BOS/EOS/SEP
    where the vocabulary adds them, none in the tiny one) and llama.cpp's
    rank pooling of it: the classification head's outputs (softmax over the
    labels for Qwen3); the score is the first."""
    import llama_cpp

    if name in RERANK_TOKENS:
        return record_generation_rerank(name, path)
    llm = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                          n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, verbose=False)
    labels = llama_cpp.llama_model_n_cls_out(llm._model.model)
    template = RERANK_CASES[name].get("rerank_template")
    prompts, outputs = [], []
    for document in DOCUMENTS:
        if template:
            text = template.replace("{query}", QUERY).replace("{document}", document)
            tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
        else:
            tokens = llm.tokenize(QUERY.encode(), add_bos=False) + llm.tokenize(document.encode(), add_bos=False)
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, False)
        llm._ctx.decode(llm._batch)
        pointer = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        prompts.append(tokens)
        outputs.append([float(pointer[i]) for i in range(labels)])
    return {"sha256": sha256(path), "prompts": prompts, "outputs": outputs, "scores": [o[0] for o in outputs]}


def record_generation_rerank(name: str, path: pathlib.Path) -> dict:
    """A relevance-generation reranker: each pair (QUERY + document, as the
    plain case builds it) evaluated, the softmax over its scoring tokens'
    logits at the last position; the score is the first."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=True,
                          verbose=False)
    ids = [llm.tokenize(token.encode(), add_bos=False) for token in RERANK_TOKENS[name]]
    assert all(len(i) == 1 for i in ids), ids
    prompts, outputs = [], []
    for document in DOCUMENTS:
        tokens = llm.tokenize(QUERY.encode(), add_bos=False) + llm.tokenize(document.encode(), add_bos=False)
        llm.reset()
        llm.eval(tokens)
        logits = np.asarray([llm.scores[len(tokens) - 1][i[0]] for i in ids], dtype=np.float64)
        probabilities = np.exp(logits - logits.max())
        prompts.append(tokens)
        outputs.append([float(p) for p in probabilities / probabilities.sum()])
    return {"sha256": sha256(path), "tokens": list(RERANK_TOKENS[name]), "prompts": prompts, "outputs": outputs,
            "scores": [o[0] for o in outputs]}


def main() -> None:
    import llama_cpp

    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "embedding_goldens.json"
    result = {
        "how": f"llama-cpp-python {llama_cpp.__version__} (AVX2 build), tiny {TENSOR_TYPE} models, seed {SEED}, "
               "Llama(embedding=True, pooling_type=...).embed(text, normalize=True)",
        "texts": TEXTS,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in CASES:
            result["cases"][name] = record(name, write_case(pathlib.Path(scratch), name))
            print(name, "recorded", file=sys.stderr)
        result["rerank"] = {"query": QUERY, "documents": DOCUMENTS, "cases": {}}
        for name in RERANK_CASES:
            result["rerank"]["cases"][name] = record_rerank(name, write_case(pathlib.Path(scratch), name))
            print(name, "recorded", file=sys.stderr)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
