"""The hooks lockgate calls. Plugins implement them with `@lockgate.hookimpl`.

Every hook is called with keyword arguments; an implementation takes only the
arguments it uses. Pipeline hooks run in a worker thread, never on the event
loop, and must be plain functions (an `async def` implementation is refused at
registration).

The annotations name lockgate's own types. They are imported for type
checkers only, so importing this module stays cheap and free of cycles (the
engine and the models import `hookimpl` from here):

* `GenerationRequest` (`lockgate.plugin_api.request`): the typed, parsed
  request, a `ChatRequest` or a `CompletionRequest`; its `body` holds the raw
  JSON for extension fields. Embeddings' and rerank's inputs come as
  `EmbeddingPrompts` (`lockgate.plugin_api.embeddings`), a
  `CompletionRequest` that generates nothing (`generates` false).
* `Model` (`lockgate.models`), `ModelSpec` (`lockgate.models`).
* `Work`, `EngineClient`, `Handle` (`lockgate.engine`): the engine seam,
  which the in-process `Engine` and engine plugins implement.
* `ErrorResponse` (`lockgate.errors`).
* `ExecutorOptions`, `Executor` (`lockgate.engine.executor`) and `ModelFile`
  (`lockgate.models.model_file`).
* `ModelFamily` (`lockgate.models.families`).
* `Drafter` (`lockgate.engine.speculation`): proposes draft tokens for
  speculative decoding.
* `ToolCallFormat` (`lockgate.plugin_api.tool_calls`).
* `ReasoningFormat` (`lockgate.plugin_api.reasoning`).
* `Settings`, `Setting` (`lockgate.settings`): every setting of `lockgate
  serve`; one setting's declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from lockgate.engine import EngineClient, Handle, Work
    from lockgate.engine.speculation import Drafter
    from lockgate.errors import ErrorResponse
    from lockgate.models import Model, ModelSpec
    from lockgate.engine.executor import Executor, ExecutorOptions
    from lockgate.models.model_file import ModelFile
    from lockgate.models.families import ModelFamily
    from lockgate.plugin_api.reasoning import ReasoningFormat
    from lockgate.plugin_api.request import GenerationRequest
    from lockgate.plugin_api.tool_calls import ToolCallFormat
    from lockgate.settings import Setting, Settings

PROJECT_NAME = "lockgate"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------
# Request pipeline: validate -> render prompt -> tokenize -> enqueue, in that
# order, in a worker thread, before any response byte is sent.
# -------------------------------------------------------------------------


@hookspec
def lockgate_validate_request(request: GenerationRequest, model: Model) -> None:
    """Apply a policy to a request before any work is done for it.

    Parsing has already checked every OpenAI parameter's type and range when
    this hook runs, so implementations hold *policy* only: limits of this
    deployment, fields it refuses, checks of extension fields in
    `request.body`. Runs once per HTTP request.

    :param request: the parsed request (`ChatRequest` or `CompletionRequest`).
    :param model: the model the request names.
    :returns: nothing; the return value is ignored.
    :raises: any exception to reject the request; `lockgate.errors` classes
        choose the HTTP status (for example `InvalidRequestError` answers 400),
        others are answered by `lockgate_handle_exception`.

    Every implementation runs.
    """


@hookspec(firstresult=True)
def lockgate_render_prompt(request: GenerationRequest, model: Model) -> str | None:
    """Turn the request into the prompt text.

    For chat completions the built-in renders `messages` through the model's
    chat template; for completions it returns the `prompt` string. Called once
    per prompt; not called when a completions prompt is given as token ids.

    :param request: the parsed request.
    :param model: the model the request names.
    :returns: the prompt, or None to leave it to the next implementation.
    :raises: `lockgate.errors.InvalidMessages` when the template refuses the
        conversation; anything else is the server's fault (500).

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def lockgate_tokenize(prompt: str, request: GenerationRequest, model: Model) -> list[int] | None:
    """Turn the rendered prompt into token ids.

    :param prompt: the text `lockgate_render_prompt` returned.
    :param request: the parsed request the prompt belongs to.
    :param model: the model whose tokenizer the ids must match.
    :returns: the token ids, or None to leave it to the next implementation.
    :raises: `lockgate.errors` classes to reject the prompt; anything else is
        the server's fault (500).

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def lockgate_enqueue(work: Work, engine: EngineClient) -> Handle | None:
    """Hand the prepared work to the engine.

    :param work: prompt token ids, sampling parameters and the request id.
    :param engine: the model's engine; the built-in calls `engine.add(work)`.
    :returns: the handle the response is read from, or None to leave it to
        the next implementation.
    :raises: the engine's admission errors (`ContextLengthExceeded`,
        `Overloaded`, `Unavailable`, ...), which reach the client as their
        status before any response byte is sent.

    Stops at the first non-None result.
    """


# -------------------------------------------------------------------------
# Errors: called on the event loop for every exception raised while serving.
# -------------------------------------------------------------------------


@hookspec(firstresult=True)
def lockgate_handle_exception(
    exception: BaseException, request: GenerationRequest | None
) -> ErrorResponse | None:
    """Turn an exception raised while serving into an error response.

    :param exception: the exception.
    :param request: the parsed request when parsing had succeeded, else None.
    :returns: the answer, or None to leave it to the next implementation
        (the built-in answers every exception).
    :raises: nothing; an implementation that raises is logged and the client
        gets a generic 500.

    Stops at the first non-None result.
    """


# -------------------------------------------------------------------------
# Registration: called while a model is loaded, at start-up.
# -------------------------------------------------------------------------


@hookspec
def lockgate_register_executors(
    register: Callable[[str, Callable[[ModelFile, ExecutorOptions], Executor]], None],
) -> None:
    """Offer executors by name.

    :param register: call `register(name, factory)`; `factory(model_file,
        options)` returns an `Executor` (prefill, decode, sequences over a
        paged KV cache; `sample`, whose default is the host sampler, for an
        executor that chooses tokens where its logits are). `--executor`
        chooses one by name.
    :returns: nothing; the return value is ignored.
    :raises: `lockgate.errors.ModelLoadError` to stop start-up with a message.

    Every implementation runs.
    """


@hookspec
def lockgate_register_engines(
    register: Callable[[str, Callable[[pluggy.PluginManager, Settings, Callable[[str], None]], Model]], None],
) -> None:
    """Offer engines by name: what runs a model's requests.

    :param register: call `register(name, load)`; `load(pm, settings,
        progress)` loads the model `settings` names and returns a `Model`
        whose `engine` is an `EngineClient` (`lockgate.engine.client`),
        calling `progress(message)` as it goes. Where the server keeps a
        memory budget over several models (`--models-memory`), `load` is
        also given `reserve=`: the callable its executor calls before it
        allocates (`ExecutorOptions.reserve`). `--engine` chooses one by
        name; `local` (built in) runs the engine in this process, `process`
        (built in) in a child process of its own. With
        `register(name, load, chosen_by="a_setting")`, giving that setting
        (one the plugin adds) chooses the engine when `--engine` is not set.
    :returns: nothing; the return value is ignored.
    :raises: `lockgate.errors.ModelLoadError` to stop start-up with a message.

    Every implementation runs.
    """


@hookspec
def lockgate_register_model_families(register: Callable[[ModelFamily], None]) -> None:
    """Offer model families: the architectures an executor can build.

    :param register: call `register(ModelFamily(name, architectures,
        networks={executor_name: network}, ...))`; a GGUF file runs when its
        `general.architecture` is one a registered family names (the first
        family to claim an architecture keeps it; built-ins register last).
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; an exception stops start-up.

    Every implementation runs.
    """


@hookspec
def lockgate_register_models(register: Callable[[ModelSpec], None]) -> None:
    """Offer models by name.

    :param register: call `register(ModelSpec(name, locate, aliases=...))`;
        `locate()` returns the GGUF path, and is called only for the model
        being served.
    :returns: nothing; the return value is ignored.
    :raises: `lockgate.errors.ModelLoadError` (best from `locate`) to stop
        start-up with a message.

    Every implementation runs.
    """


@hookspec
def lockgate_add_settings(register: Callable[[Setting], None]) -> None:
    """Add settings of a plugin's own to `lockgate serve` (pytest's
    `pytest_addoption` is the model).

    :param register: call `register(Setting(name, type, default, help))`
        (`lockgate.settings.Setting`) once per setting: it becomes the flag
        `--name`, the variable `LOCKGATE_NAME` and a row of the settings
        table; its value reaches the plugin as `settings.name` (the
        `Settings` an engine's loader gets) and in
        `ExecutorOptions.plugin_settings` (what an executor factory gets).
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; a name that is taken stops start-up.

    Every implementation runs.
    """


@hookspec
def lockgate_add_request_fields(register: Callable[..., None]) -> None:
    """Declare request fields a plugin reads from `request.body` itself.

    lockgate refuses a field no row of an endpoint's field table names
    (`lockgate.plugin_api.fields`): an extension a plugin implements must be
    declared to reach it.

    :param register: call `register(name, endpoints=("chat.completions",
        "completions"))` once per field; the endpoints are those of
        `lockgate.plugin_api.fields.FIELDS` (`responses`, `messages`,
        `tokenize` too).
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; a field lockgate reads itself, or an unknown
        endpoint, stops start-up.

    Every implementation runs.
    """


@hookspec
def lockgate_register_tool_call_formats(register: Callable[[type[ToolCallFormat]], None]) -> None:
    """Offer tool-call formats: how a model family writes tool calls.

    :param register: call `register(FormatClass)` with a `ToolCallFormat`
        subclass; its `name` is what `--tool-call-format` takes, and its
        `fits(chat_template)` says whether a model's template writes calls
        its way (the first registered format that fits is chosen; built-ins
        come last, the catch-all `generic` last of all).
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; an exception stops start-up.

    Every implementation runs.
    """


@hookspec
def lockgate_register_reasoning_formats(register: Callable[[type[ReasoningFormat]], None]) -> None:
    """Offer reasoning formats: how a model family writes its thinking apart
    from its answer (`<think>...</think>` before it, for DeepSeek-R1 and Qwen3).

    :param register: call `register(FormatClass)` with a `ReasoningFormat`
        subclass; its `name` is what `--reasoning-format` takes, and its
        `fits(chat_template)` says whether a model's template writes its
        thinking that way (the first registered format that fits is chosen;
        built-ins come last).
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; an exception stops start-up.

    Every implementation runs.
    """


@hookspec
def lockgate_register_drafters(register: Callable[[type[Drafter]], None]) -> None:
    """Offer drafters for speculative decoding: what proposes a choice's
    next tokens for the engine to verify several a step.

    :param register: call `register(DrafterClass)` with a
        `lockgate.engine.speculation.Drafter` subclass (made with no
        arguments, one instance per engine); drafters are asked in
        registration order, plugins' before the built-ins (`prediction`,
        `grammar`, `prompt_lookup`, `ngram_memory`), and the first that
        proposes tokens wins.
    :returns: nothing; the return value is ignored.
    :raises: nothing by design; an exception stops start-up.

    Every implementation runs.
    """


# -------------------------------------------------------------------------
# Start-up: called once in a process started to serve, before a model loads.
# -------------------------------------------------------------------------


@hookspec
def lockgate_serving_process() -> None:
    """Prepare a process that serves (`lockgate serve`, gunicorn, aiohttp's
    launcher), before it loads a model.

    Tests and tools that load models without serving do not call it. The
    built-in TVM plugin makes the process load TVM's runtime library
    without its compiler.

    :returns: nothing; the return value is ignored.
    :raises: nothing by design; an exception stops start-up.

    Every implementation runs.
    """
