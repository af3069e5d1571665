"""lm-evaluation-harness, unmodified, against `lockgate serve`: a
multiple-choice task of 24 questions (tests/data/lm_eval, no download) run
with its `local-completions` model and the server's own tokenizer
(`tokenizer_backend=remote`). The accuracy it reports must be the one
worked out directly from lockgate's logprobs of each choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from paths import DATA
from processes import free_port, stop, wait_healthy

pytestmark = pytest.mark.slow

TASK_DIR = DATA / "lm_eval"


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def choice_logprob(port: int, context: str, choice: str) -> float:
    """The log-probability of `choice` after `context`, as the harness
    defines it (the continuation's tokens are the whole text's past the
    context's), from one echoed prompt with nothing generated."""
    tokenize = lambda text: post(port, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]  # noqa: E731
    context_ids, whole = tokenize(context), tokenize(f"{context} {choice}")
    answer = post(port, "/v1/completions", {"model": "tiny", "prompt": whole, "echo": True, "logprobs": 1,
                                            "max_tokens": 0, "temperature": 0})
    return sum(answer["choices"][0]["logprobs"]["token_logprobs"][len(context_ids):])


def test_lm_eval_reports_the_accuracy_lockgates_logprobs_give(tiny_gguf, tmp_path):
    port = free_port()
    # the log goes to a file: hundreds of requests' lines would fill a pipe nobody reads
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", str(tiny_gguf),
             "--served-model-name", "tiny", "--port", str(port), "--max-total-tokens", "4096"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
        )
    try:
        wait_healthy(process, port)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
        env.pop("OPENAI_API_KEY", None)
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
             "--model_args", f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote",
             "--tasks", "lockgate_mc", "--include_path", str(TASK_DIR), "--batch_size", "4",
             "--output_path", str(tmp_path / "out"), "--log_samples"],
            capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        [results_file] = (tmp_path / "out").glob("**/results_*.json")
        reported = json.loads(results_file.read_text())["results"]["lockgate_mc"]["acc,none"]
        [samples_file] = (tmp_path / "out").glob("**/samples_lockgate_mc_*.jsonl")
        samples = {s["doc_id"]: s for s in map(json.loads, samples_file.read_text().splitlines())}

        docs = [json.loads(line) for line in (TASK_DIR / "lockgate_mc.jsonl").read_text().splitlines()]
        assert len(docs) == len(samples) >= 20
        correct = 0
        for doc_id, doc in enumerate(docs):
            ours = [choice_logprob(port, doc["question"], choice) for choice in doc["choices"]]
            theirs = [float(logprob) for logprob, _ in samples[doc_id]["filtered_resps"]]
            # the harness sent a token more (max_tokens 1), in batches of 4
            assert ours == pytest.approx(theirs, abs=2e-3), doc
            correct += max(range(len(ours)), key=ours.__getitem__) == doc["answer"]
        assert reported == pytest.approx(correct / len(docs), abs=1e-9)
    finally:
        stop(process)
