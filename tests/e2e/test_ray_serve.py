"""Scale-out on Ray Serve: the same answers, errors and clean-up as one local
engine, across replica processes, with prefix affinity and a replica killed
mid-stream.

Two real set-ups, two engine replicas each on the tiny model:
* `ray_server`: `lockgate serve --replicas 2 --ray-address local`, which
  starts Ray and deploys the replicas itself (on the slow executor);
* `attached_server`: the replicas deployed as deploy/kuberay-rayservice.yaml's
  `serveConfigV2` says (by `ray_app_driver.py`, as a RayService would), and
  `lockgate serve --ray-address ADDRESS` attaching to them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import yaml

from paths import ROOT, SUPPORT
from helpers import TINY_EXECUTOR, wait_for
from lockgate.plugin_api.manager import get_plugin_manager
from poisoned_executor import POISON
from processes import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TESTS = SUPPORT  # what replicas import the test doubles from
EXECUTOR_FLAGS = [f"--{key.replace('_', '-')}={value}" for key, value in TINY_EXECUTOR.items()]


MANIFEST = ROOT / "deploy" / "kuberay-rayservice.yaml"
ENV = {
    **os.environ,
    "LOCKGATE_PLUGINS": "poisoned_executor,slow_executor",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    "RAY_AUTH_MODE": "disabled",
}


class RayServer:
    def __init__(self, tiny_gguf, tmp_path, *flags: str, model: str = "tiny", ray_address: str = "local") -> None:
        self.port = free_port()
        self.model = model
        self.log = open(tmp_path / f"serve-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lockgate.server.cli", "serve", "--model", str(tiny_gguf),
             "--served-model-name", model, "--port", str(self.port), "--replicas", "2",
             "--ray-address", ray_address, "--cpus-per-replica", "0.5", "--num-threads", "1",
             *EXECUTOR_FLAGS, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 240
        while not self._replicas_up(2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not start:\n{self.output()}")
            time.sleep(0.5)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-6000:]

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)
        except OSError:
            return 0, {}

    def replicas(self) -> dict[str, dict]:
        status, body = self.health()
        return body.get("models", {}).get(self.model, {}).get("replicas", {}) if body else {}

    def _replicas_up(self, count: int) -> bool:
        return len(self.replicas()) >= count

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def ray_server(tiny_gguf, tmp_path_factory):
    # the slow executor (the real one, 10 ms more a decode step): a stream
    # is still running when a test kills its replica
    server = RayServer(tiny_gguf, tmp_path_factory.mktemp("ray"), "--executor", "slow")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def attached_server(tiny_gguf, tmp_path_factory):
    """The manifest's engine application with one sequence and one waiting
    request per replica and the poisoned executor, and a front attached to it."""
    tmp_path = tmp_path_factory.mktemp("ray-attached")
    service = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "RayService")
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    overrides = {
        "model": str(tiny_gguf), "target": "llvm", "gpus_per_replica": "0", "cpus_per_replica": "0.5",
        "num_threads": "1", **{k: str(v) for k, v in TINY_EXECUTOR.items()},
        "executor": "poisoned", "max_num_seqs": "1", "max_queue": "1",
    }
    driver_log = open(tmp_path / "driver.log", "w+")
    driver = subprocess.Popen(
        [sys.executable, str(TESTS / "ray_app_driver.py"), str(MANIFEST), json.dumps(overrides)],
        stdout=subprocess.PIPE, stderr=driver_log, text=True, env=ENV, start_new_session=True)
    try:
        address = driver.stdout.readline().strip()
        assert address, _tail(driver_log)
        server = RayServer(tiny_gguf, tmp_path, "--executor", "poisoned", "--max-num-seqs", "1",
                           "--max-queue", "1", model=args["served_model_name"], ray_address=address)
        assert "attaching to the engine replicas" in server.output()
        yield server
        server.stop()
    finally:
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        driver_log.close()


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-6000:]


def prompts(count: int) -> list[str]:
    # different from the first token on: no prefix is shared between them
    return [f"{i} lamps light {i * 7} rooms" for i in range(count)]


async def stream_text(client, prompt: str, **params) -> tuple[str, str | None]:
    stream = await client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True, **params)
    text = []
    async for chunk in stream.parse():
        text.extend(choice.text for choice in chunk.choices)
    return "".join(text), stream.headers.get("x-lockgate-replica")


async def test_two_replicas_answer_as_one_local_engine(ray_server, tiny_model, make_openai):
    local = await make_openai(tiny_model)
    expected = [await stream_text(local, p) for p in prompts(20)]
    remote = ray_server.client()
    got = await asyncio.gather(*(stream_text(remote, p) for p in prompts(20)))
    await remote.close()
    assert [text for text, _ in got] == [text for text, _ in expected]
    served_by = {replica for _, replica in got}
    assert served_by <= set(ray_server.replicas()) and len(served_by) == 2, served_by
    # the per-replica gauges, and the replicas' events in the front's
    # counters (posted twice a second)
    def metrics():
        with urllib.request.urlopen(ray_server.url + "/metrics") as response:
            text = response.read().decode()
        return text if 'lockgate_generation_tokens_total{model="tiny"}' in text else None

    text = await wait_for(metrics, timeout=10, what="the replicas' counters")
    for replica in served_by:
        assert f'lockgate_replica_kv_pages_total{{model="tiny",replica="{replica}"}}' in text


async def test_structured_output_n_and_logprobs_across_the_wire(ray_server, tiny_model, make_openai):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    params = dict(model="tiny", messages=[{"role": "user", "content": "give a"}], max_tokens=40, temperature=0,
                  n=2, logprobs=True, top_logprobs=2,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    local = await make_openai(tiny_model)
    remote = ray_server.client()
    want = await local.chat.completions.create(**params)
    got = await remote.chat.completions.create(**params)
    await remote.close()
    assert [c.message.content for c in got.choices] == [c.message.content for c in want.choices]
    assert [[t.token for t in c.logprobs.content] for c in got.choices] == \
        [[t.token for t in c.logprobs.content] for c in want.choices]
    assert isinstance(json.loads(got.choices[0].message.content)["a"], bool)


async def test_embeddings_across_the_wire(ray_server, tiny_model, make_openai):
    """Pooled requests travel as any other: the replicas' vectors are the
    local engine's."""
    local = await make_openai(tiny_model)
    remote = ray_server.client()
    texts = prompts(5)
    want = await local.embeddings.create(model="tiny", input=texts, encoding_format="float")
    got = await remote.embeddings.create(model="tiny", input=texts, encoding_format="float")
    await remote.close()
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    for mine, theirs in zip(got.data, want.data):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-5)


async def test_tool_calls_across_the_wire(ray_server, tiny_model, make_openai):
    tool = {"type": "function", "function": {
        "name": "lamp", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}},
                                       "required": ["on"]}}}
    params = dict(model="tiny", messages=[{"role": "user", "content": "switch it"}], tools=[tool],
                  tool_choice="required", max_tokens=60, temperature=0)
    local = await make_openai(tiny_model)
    remote = ray_server.client()
    want = await local.chat.completions.create(**params)
    got = await remote.chat.completions.create(**params)
    await remote.close()
    calls = got.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lamp"
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls]


async def test_prefix_affinity_keeps_a_shared_prompt_on_one_replica(ray_server):
    system = "You answer about lamps. " * 12
    remote = ray_server.client()
    replicas = []
    for i in range(6):
        reply = await remote.chat.completions.with_raw_response.create(
            model="tiny", max_tokens=4,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
        replicas.append(reply.headers["x-lockgate-replica"])
    await remote.close()
    assert len(set(replicas)) == 1, replicas


async def test_client_disconnect_frees_the_remote_kv_pages(ray_server):
    remote = ray_server.client()
    stream = await remote.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "go on"}], max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    chunks = 0
    async for _ in stream:
        chunks += 1
        if chunks == 3:
            break
    await stream.close()
    await remote.close()

    def pages_free():
        replicas = ray_server.replicas()
        return replicas and all(f["kv_pages_used"] == 0 and f["requests_running"] == 0 for f in replicas.values())

    await wait_for(pages_free, timeout=30, what="remote KV pages freed")


async def test_over_long_prompt_is_400_streamed_or_not(attached_server):
    remote = attached_server.client()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            await remote.chat.completions.create(
                model=attached_server.model, messages=[{"role": "user", "content": "lamp " * 3000}],
                max_tokens=4, stream=stream)
        assert caught.value.body["code"] == "context_length_exceeded"
        assert caught.value.body["param"] == "messages"
    await remote.close()


async def test_every_replica_full_is_429_with_retry_after(attached_server):
    remote = attached_server.client()

    async def one(i):
        try:
            reply = await remote.chat.completions.with_raw_response.create(
                model=attached_server.model, messages=[{"role": "user", "content": f"{i}"}], max_tokens=60,
                extra_body={"ignore_eos": True})
            return reply.status_code, None
        except openai.RateLimitError as exc:
            return 429, exc.response.headers.get("retry-after")

    results = await asyncio.gather(*(one(i) for i in range(16)))
    await remote.close()
    refused = [retry for status, retry in results if status == 429]
    assert refused and all(retry for retry in refused), results
    assert any(status == 200 for status, _ in results), results


async def test_mid_stream_fault_is_an_in_stream_error_as_locally(attached_server, load_tiny, make_openai):
    import poisoned_executor

    async def failed_stream(client, model):
        stream = await client.completions.create(
            model=model, prompt=[5, POISON, 9, 11], max_tokens=30, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        texts = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        # greedy, so both sides generate the same tokens before the fault (a
        # token whose bytes are not yet whole UTF-8 sends no chunk)
        return texts, caught.value

    pm = get_plugin_manager(autoload=False, plugins=[poisoned_executor])
    local = await make_openai(load_tiny(pm=pm, executor="poisoned"))
    want_chunks, want = await failed_stream(local, "tiny")
    remote = attached_server.client()
    got_chunks, got = await failed_stream(remote, attached_server.model)
    # the replica is fine afterwards
    # sampled, a random model may pick EOS within three tokens: "length" is
    # certain only with EOS ignored
    reply = await remote.completions.create(model=attached_server.model, prompt="lamps", max_tokens=3,
                                            extra_body={"ignore_eos": True})
    await remote.close()
    assert got_chunks == want_chunks
    assert (got.body or {}).get("type") == (want.body or {}).get("type")
    assert (got.body or {}).get("code") == (want.body or {}).get("code")
    assert reply.choices[0].finish_reason == "length"


async def test_a_replica_killed_mid_stream(ray_server):
    """Runs last in this module: it kills a replica process."""
    remote = ray_server.client()
    before = ray_server.replicas()
    assert len(before) == 2

    async def open_stream(i):
        response = await remote.completions.with_raw_response.create(
            model="tiny", prompt=f"{i} long", max_tokens=300, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return response.headers["x-lockgate-replica"], response.parse()

    async def read(replica, stream):
        count = 0
        try:
            async for _ in stream:
                count += 1
        except openai.APIError as exc:
            return replica, count, exc
        return replica, count, None

    # streams until both replicas run some (the router picks by load, so soon)
    opened = []
    while len({replica for replica, _ in opened}) < 2:
        assert len(opened) < 16, opened
        opened.append(await open_stream(len(opened)))
    tasks = [asyncio.ensure_future(read(replica, stream)) for replica, stream in opened]
    victim, victim_figures = sorted(ray_server.replicas().items())[0]
    killed_at = time.monotonic()
    os.kill(victim_figures["pid"], signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    ended_in = time.monotonic() - killed_at
    on_victim = [r for r in results if r[0] == victim]
    others = [r for r in results if r[0] != victim]
    assert on_victim and others, results
    for _, _, error in on_victim:
        assert error is not None and error.body["code"] == "replica_lost", error
    for _, count, error in others:
        assert error is None and count > 0
    assert ended_in < 60
    # new requests succeed at once, on the survivors, while the server stays healthy
    assert ray_server.health()[0] == 200
    reply = await remote.completions.create(model="tiny", prompt="after", max_tokens=3,
                                            extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    await remote.close()
    # and Ray Serve brings the replica back
    await wait_for(lambda: len(ray_server.replicas()) == 2 and victim not in ray_server.replicas(),
                   timeout=120, what="a replacement replica")
