"""Starting the server as users do: `lockgate serve`, aiohttp's launcher,
gunicorn's aiohttp worker; graceful SIGTERM; a clear error for a bad model."""

from __future__ import annotations

import pytest

import json
import signal
import subprocess
import sys

import openai
from processes import free_port, start, stop, wait_healthy

pytestmark = pytest.mark.slow


def chat(port: int, model: str = "tiny") -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    client.close()
    return reply.choices[0].finish_reason


def serve_tiny(tiny_gguf, *flags: str):
    """`lockgate serve` of the tiny model as "tiny" on a free port, started and healthy."""
    port = free_port()
    process = start(
        [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", str(tiny_gguf),
         "--served-model-name", "tiny", "--port", str(port), *flags]
    )
    try:
        wait_healthy(process, port)
    except BaseException:
        stop(process)
        raise
    return process, port


def test_lockgate_serve(tiny_gguf):
    process, port = serve_tiny(tiny_gguf, "--max-total-tokens", "2048")
    try:
        assert chat(port) in ("stop", "length")
    finally:
        code, err = stop(process)
    assert code == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    summaries = [line for line in lines if line.get("event") == "request" and line["path"] == "/v1/chat/completions"]
    assert summaries and summaries[0]["status"] == 200 and summaries[0]["request_id"]
    assert summaries[0]["completion_tokens"] >= 1 and summaries[0]["prompt_tokens"] > 0
    assert any("compil" in line["event"] or "loading" in line["event"] for line in lines)


def test_aiohttp_launcher(tiny_gguf):
    port = free_port()
    process = start(
        [sys.executable, "-m", "aiohttp.web", "-H", "127.0.0.1", "-P", str(port),
         "lockgate.server.app:init_app", "--model", str(tiny_gguf), "--served-model-name", "tiny"],
    )
    try:
        wait_healthy(process, port)
        assert chat(port) in ("stop", "length")
    finally:
        stop(process)


def test_gunicorn_worker(tiny_gguf):
    """gunicorn is a declared test dependency: run it from this interpreter,
    whether or not its script is on PATH."""
    port = free_port()
    process = start(
        [sys.executable, "-m", "gunicorn", "lockgate.server.app:app_from_env()", "-k", "aiohttp.GunicornWebWorker",
         "-b", f"127.0.0.1:{port}", "--timeout", "300"],
        {"LOCKGATE_MODEL": str(tiny_gguf), "LOCKGATE_SERVED_MODEL_NAME": "tiny"},
    )
    try:
        wait_healthy(process, port)
        assert chat(port) in ("stop", "length")
    finally:
        code, err = stop(process)
    assert code == 0, err


def test_serve_reports_a_bad_model_clearly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "neither a registered model" in result.stderr
    assert "Traceback" not in result.stderr


def test_sigterm_lets_in_flight_requests_finish(tiny_gguf):
    import http.client

    process, port = serve_tiny(tiny_gguf, "--shutdown-grace", "30")
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": "tiny", "prompt": "the", "max_tokens": 400, "ignore_eos": True, "stream": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        first = response.readline()
        assert first.startswith(b"data: ")
        process.send_signal(signal.SIGTERM)
        rest = response.read().decode()
        events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        code, err = stop(process)
    assert code == 0, err
