"""The hooks lockgate calls. Plugins implement them with `@lockgate.hookimpl`.

Every hook is called with keyword arguments; an implementation takes only the
arguments it uses. Pipeline hooks run in a worker thread, never on the event
loop, and must be plain functions (an `async def` implementation is refused at
registration).
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "lockgate"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def lockgate_validate_request(request, model):
    """Check a request before any work is done for it.

    :param request: the `lockgate.plugin_api.request.Request` (its `body` is the parsed JSON).
    :param model: the `lockgate.models.Model` the request names.
    :returns: nothing; the return value is ignored.
    :raises: any exception to reject the request; `lockgate.errors` classes
        choose the HTTP status (for example `InvalidRequestError` answers 400).

    Every implementation runs.
    """


@hookspec(firstresult=True)
def lockgate_render_prompt(request, model):
    """Turn the request into the prompt text.

    For chat completions the built-in renders `messages` through the model's
    chat template; for completions it returns the `prompt` string.

    :returns: the prompt as `str`.
    :raises: `lockgate.errors.InvalidMessages` when the template refuses the
        conversation.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def lockgate_tokenize(prompt, request, model):
    """Turn the rendered prompt into token ids.

    :param prompt: the text `lockgate_render_prompt` returned.
    :returns: `list[int]` of token ids.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def lockgate_enqueue(work, engine):
    """Hand the prepared work to the engine.

    :param work: a `lockgate.plugin_api.request.Work` (prompt tokens, sampling parameters).
    :param engine: the model's `lockgate.engine.Engine`.
    :returns: the `lockgate.engine.RequestHandle` the response is read from.
    :raises: the engine's admission errors (`ContextLengthExceeded`,
        `Overloaded`, `Unavailable`, ...), which reach the client as their
        status before any response byte is sent.

    Stops at the first non-None result.
    """


@hookspec(firstresult=True)
def lockgate_handle_exception(exception, request):
    """Turn an exception raised while serving into an error response.

    :param exception: the exception.
    :param request: the `lockgate.plugin_api.request.Request` when one had been built,
        else None.
    :returns: a `lockgate.plugin_api.request.ErrorResponse`, or None to leave it to the
        next implementation (the built-in answers every exception).

    Stops at the first non-None result.
    """


@hookspec
def lockgate_register_executors(register):
    """Offer executors.

    :param register: call `register(name, factory)` where `factory(model_file,
        options)` returns a `lockgate.models.executor.Executor`.

    Every implementation runs.
    """


@hookspec
def lockgate_register_models(register):
    """Offer models by name.

    :param register: call `register(lockgate.models.ModelSpec(...))`.

    Every implementation runs.
    """
