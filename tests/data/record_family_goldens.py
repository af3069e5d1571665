"""Record llama.cpp's answers on the tiny model of each family: the
reference `tests/unit/tvm/test_family_goldens.py` checks lockgate against.

Run with a Python that has llama-cpp-python 0.3.36 (built once from its
sdist, e.g. `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON" pip install llama-cpp-python==0.3.36`) and gguf:

    python tests/data/record_family_goldens.py [OUT.json [CASE ...]]

(with CASEs named, only those are recorded again; the others are kept)

For each case it writes the tiny GGUF with `tests/support/tiny_model.py`, evaluates
the prompt, then takes 40 greedy steps (argmax of llama.cpp's logits, end
of turn not treated as a stop), recording at each step the chosen id, the
margin to the runner-up and llama.cpp's top-8 logits. The file's sha256 is
recorded so a changed writer is caught rather than compared.
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

from tiny_model import KQUANT_CONFIG, Q4_K_M, Q5_K_M, write_tiny_gguf  # noqa: E402

#: Llama 3.1's factors at the tiny head size (see test_model_families)
LLAMA3_FACTORS = [1.0, 1.0, 1.0, 1.6, 3.2, 8.0, 8.0, 8.0]

#: Gemma 3's parts: every second layer global, local layers of a 64-token
#: window rotating with their own base, soft-capped logits
GEMMA3 = {
    "architecture": "gemma3", "qk_norm": True, "head_dim": 32, "num_layers": 4,
    "sliding_window": 64, "sliding_window_pattern": 2, "rope_local_theta": 10000.0,
    "rope_theta": 1000000.0, "final_logit_softcap": 30.0, "context_length": 4096,
}

#: name: (writer overrides, prompt length, greedy steps)
CASES = {
    "llama": ({}, 24, 40),
    "llama3-rope-scaling-2048": (
        {"rope_freq_factors": LLAMA3_FACTORS, "context_length": 4096}, 2048, 40,
    ),
    "qwen2": ({"architecture": "qwen2", "attention_bias": True}, 24, 40),
    "qwen3": ({"architecture": "qwen3", "qk_norm": True, "head_dim": 32, "rope_theta": 1000000.0}, 24, 40),
    "gemma3": (dict(GEMMA3, sliding_window=16), 24, 40),
    "gemma3-window-2048": (GEMMA3, 2048, 40),
    # the quantizations people download, on shapes of whole K-quant blocks
    "llama-q4_k_m": (KQUANT_CONFIG, 24, 40),
    "llama-q5_k_m": (KQUANT_CONFIG, 24, 40),
    "qwen2-q6_k": (dict(KQUANT_CONFIG, architecture="qwen2", attention_bias=True), 24, 40),
    # a small model's Q4_K_M: rows too short for K-quants fall back to Q5_0/Q8_0
    "qwen2-small-q4_k_m": ({"architecture": "qwen2", "attention_bias": True}, 24, 40),
}

#: the weights' GGML types of a case: (type of the 2-D weights, per-tensor
#: types over it); the others are F16
TYPES = {
    "llama-q4_k_m": ("Q4_K", Q4_K_M),
    "llama-q5_k_m": ("Q5_K", Q5_K_M),
    "qwen2-q6_k": ("Q6_K", {}),
    "qwen2-small-q4_k_m": (
        "Q5_0", {"attn_v.weight": "Q8_0", "ffn_down.weight": "Q8_0", "output.weight": "Q8_0"}
    ),
}

#: every case has its own LM head: with tied embeddings a random model's
#: greedy steps repeat the last token forever, which agrees trivially
COMMON = {"tie_word_embeddings": False}

TENSOR_TYPE = "F16"
SEED = 21
TOP = 8


def write_case(directory: pathlib.Path, name: str) -> pathlib.Path:
    overrides, _, _ = CASES[name]
    tensor_type, tensor_types = TYPES.get(name, (TENSOR_TYPE, {}))
    return write_tiny_gguf(
        directory / f"{name}.gguf",
        tensor_type=tensor_type,
        tensor_types=tensor_types,
        seed=SEED,
        **{**COMMON, **overrides},
    )


def prompt_ids(name: str) -> list[int]:
    _, length, _ = CASES[name]
    rng = np.random.default_rng(len(name) * 1000 + length)
    return rng.integers(3, 299, length).tolist()


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def record(name: str, path: pathlib.Path) -> dict:
    import llama_cpp

    _, length, steps = CASES[name]
    prompt = prompt_ids(name)
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=length + steps + 16, n_batch=512, n_threads=2,
        logits_all=True, verbose=False,
    )
    llm.eval(prompt)
    greedy, margins, tops = [], [], []
    for _ in range(steps):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        order = np.argsort(-logits)
        greedy.append(int(order[0]))
        margins.append(float(logits[order[0]] - logits[order[1]]))
        tops.append([[int(i), float(logits[i])] for i in order[:TOP]])
        llm.eval([int(order[0])])
    return {
        "sha256": sha256(path),
        "prompt_ids": prompt,
        "greedy_ids": greedy,
        "margins": margins,
        "top_logits": tops,
    }


def main() -> None:
    import llama_cpp

    out = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "family_goldens.json"
    previous = json.loads(out.read_text())["cases"] if out.exists() else {}
    only = sys.argv[2:]  # case names to record again; the others are kept
    result = {
        "how": (
            f"llama-cpp-python {llama_cpp.__version__} (AVX2 build), tiny {TENSOR_TYPE} models "
            f"(the quantized cases: the types of TYPES) from tests/support/tiny_model.py (seed {SEED}), prompt evaluated at once, then greedy argmax steps "
            f"over the last logits, end of turn not a stop; margins[i] = top1 - top2 logit; "
            f"top_logits[i] = llama.cpp's {TOP} largest logits as [id, logit]"
        ),
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in CASES:
            if only and name not in only and name in previous:
                result["cases"][name] = previous[name]
                continue
            result["cases"][name] = record(name, write_case(pathlib.Path(tmp), name))
            print(name, result["cases"][name]["greedy_ids"][:10], file=sys.stderr)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
