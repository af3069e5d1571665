"""The serving skeleton (`lockgate.server.serving`) on its own: no model, no
engine, no pipeline. Handles are scripted test doubles; the pipeline is
replaced by one that hands them over. What it must do whatever the
endpoint: type the body before the pipeline, abort every handle however
the answer ends, note the usage, merge the deltas of several handles with
their choices' indexes, turn a failure after the headers into the
protocol's error event, and let a client that stops reading go."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from lockgate.engine import Delta, Usage
from lockgate.errors import ErrorResponse, InvalidRequestError
from lockgate.server import serving
from lockgate.server.keys import HANDLES, MODELS, PIPELINE_REQUEST, PLUGIN_MANAGER, REQUEST_ID, USAGE
from lockgate.server.middlewares import error_middleware, request_id_middleware
from lockgate.plugin_api.manager import get_plugin_manager


class ScriptedHandle:
    """A handle that delivers `deltas` (then its end) once subscribed, on
    the event loop, one per loop turn, or fails with `error` after them."""

    def __init__(self, deltas, *, n: int = 1, error: BaseException | None = None, hold: bool = False) -> None:
        self.deltas, self.n, self.error, self.hold = list(deltas), n, error, hold
        self.usage = Usage(prompt_tokens=3, completion_tokens=len(self.deltas))
        self.replica = None
        self.work = None
        self.aborted = 0

    def subscribe(self, callback) -> None:
        loop = asyncio.get_running_loop()

        async def feed() -> None:
            for delta in self.deltas:
                await asyncio.sleep(0)
                callback(delta)
            if self.hold:
                return  # a request still generating
            callback(self.error)  # None: the end

        self.task = loop.create_task(feed())

    def abort(self) -> None:
        self.aborted += 1


def text(index: int, piece: str, finish: str | None = None) -> Delta:
    return Delta(index=index, text=piece, token_ids=[1], finish_reason=finish)


class Served:
    """The one model the app serves (its name is all the skeleton asks of
    it), leased as `ModelFleet.acquire` leases it."""

    name = "m"

    def __init__(self) -> None:
        self.leases = 0

    async def acquire(self, name):
        if name not in (None, "m"):
            raise InvalidRequestError(f"no model {name!r}", param="model")
        self.leases += 1
        return self

    @property
    def model(self):
        return self

    def release(self) -> None:
        self.leases -= 1


@pytest.fixture
def serve(aiohttp_client, monkeypatch):
    """`await serve(handles, answer, parse=...)`: a client of an app whose one
    route runs `serving.generate` with the pipeline handing over `handles`;
    returns the client and what the skeleton left on the request."""

    async def make(handles, answer, parse=None):
        seen: dict = {}

        async def pipeline(pm, typed, model):
            seen["typed"] = typed
            return handles

        monkeypatch.setattr(serving, "run_pipeline", pipeline)

        async def route(request: web.Request) -> web.StreamResponse:
            try:
                return await serving.generate(request, parse or (lambda r, body, m: body), answer)
            finally:
                seen.update(usage=request.get(USAGE), handles=request.get(HANDLES),
                            typed_on_request=request.get(PIPELINE_REQUEST))

        app = web.Application(middlewares=[request_id_middleware, error_middleware])
        app[MODELS] = Served()
        app[PLUGIN_MANAGER] = get_plugin_manager(autoload=False)
        app.router.add_post("/generate", route)
        return await aiohttp_client(app), seen

    return make


async def collect(request, typed, model, handles):
    """An endpoint's whole answer: every (index, text) in arrival order."""
    got = [(index, delta.text) async for index, delta in serving.MergedDeltas(request, handles)]
    return web.json_response({"got": got, "id": request[REQUEST_ID]})


async def test_a_whole_answer_merges_its_handles_and_aborts_them_after(serve):
    first = ScriptedHandle([text(0, "a"), text(1, "b"), text(0, "c", "stop"), text(1, "d", "stop")], n=2)
    second = ScriptedHandle([text(0, "e", "length")])
    client, seen = await serve([first, second], collect)
    response = await client.post("/generate", json={"model": "m", "x": 1})
    assert response.status == 200
    got = (await response.json())["got"]
    # the second handle's choice follows the first's two
    assert sorted(got) == [[0, "a"], [0, "c"], [1, "b"], [1, "d"], [2, "e"]]
    assert [piece for index, piece in got if index == 0] == ["a", "c"]  # a choice's own order kept
    assert seen["typed"] == {"model": "m", "x": 1} and seen["typed_on_request"] == seen["typed"]
    assert first.aborted == second.aborted == 1  # a no-op for a finished handle, but always sent
    assert seen["usage"] == Usage(prompt_tokens=6, completion_tokens=5)


async def test_what_is_refused_before_the_pipeline_never_reaches_it(serve):
    def parse(request, body, model):
        raise InvalidRequestError("temperature must be a number", param="temperature")

    client, seen = await serve([ScriptedHandle([])], collect, parse=parse)
    response = await client.post("/generate", json={"model": "m"})
    assert response.status == 400 and (await response.json())["error"]["param"] == "temperature"
    assert "typed" not in seen and seen["handles"] is None
    for body, status in ((b"{not json", 400), (b"[1]", 400)):
        response = await client.post("/generate", data=body, headers={"Content-Type": "application/json"})
        assert response.status == status
    response = await client.post("/generate", json={"model": "other"})
    assert response.status == 400 and (await response.json())["error"]["param"] == "model"


async def test_an_answer_that_fails_still_aborts_and_notes_usage(serve):
    handle = ScriptedHandle([text(0, "a")], hold=True)

    async def fails(request, typed, model, handles):
        raise RuntimeError("a writer's bug")

    client, seen = await serve([handle], fails)
    response = await client.post("/generate", json={})
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "internal_error"
    assert handle.aborted == 1 and seen["usage"] == Usage(prompt_tokens=3, completion_tokens=1)


async def test_a_client_gone_while_waiting_is_logged_as_499_and_aborts(serve):
    handle = ScriptedHandle([], hold=True)

    async def gone(request, typed, model, handles):
        raise ConnectionResetError("the client disconnected")

    client, seen = await serve([handle], gone)
    response = await client.post("/generate", json={})
    assert response.status == 499
    assert handle.aborted == 1


async def stream_answer(request, typed, model, handles):
    async def write(response, deltas):
        async for index, delta in deltas:
            await serving.write_event(request, response, json.dumps({"i": index, "t": delta.text}))

    async def write_error(response, answer: ErrorResponse):
        await serving.write_event(request, response, json.dumps({"error": answer.status, "code": answer.code}),
                                  event="error")

    return await serving.event_stream(request, handles, write, write_error)


def events(body: str) -> list[tuple[str | None, dict]]:
    out = []
    for frame in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


async def test_a_stream_writes_its_events_and_ends(serve):
    handle = ScriptedHandle([text(0, "a"), text(0, "b", "stop")])
    client, _ = await serve([handle], stream_answer)
    response = await client.post("/generate", json={})
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    assert events(await response.text()) == [(None, {"i": 0, "t": "a"}), (None, {"i": 0, "t": "b"})]
    assert handle.aborted == 1


async def test_a_failure_after_the_headers_is_the_protocols_error_event(serve):
    """The status is gone once the headers are: the engine's failure comes
    as the answer the error middleware would have sent, in an event."""
    handle = ScriptedHandle([text(0, "a")], error=InvalidRequestError("the grammar ended", param="grammar"))
    client, _ = await serve([handle], stream_answer)
    response = await client.post("/generate", json={})
    assert response.status == 200
    assert events(await response.text()) == [(None, {"i": 0, "t": "a"}),
                                              ("error", {"error": 400, "code": "invalid_value"})]


async def test_a_stream_whose_client_does_not_read_is_aborted(serve, monkeypatch):
    """Past `STREAM_BACKLOG_LIMIT` unread deltas the request is aborted:
    the engine generates no further for a client that does not read."""
    monkeypatch.setattr(serving, "STREAM_BACKLOG_LIMIT", 4)
    handle = ScriptedHandle([text(0, str(i)) for i in range(50)], hold=True)

    async def never_reads(request, typed, model, handles):
        deltas = serving.MergedDeltas(request, handles, backlog_limit=serving.STREAM_BACKLOG_LIMIT)
        await asyncio.sleep(0.2)  # the deltas pile up meanwhile
        async for _ in deltas:
            pass
        return web.json_response({})

    client, seen = await serve([handle], never_reads)
    with pytest.raises(aiohttp.ServerDisconnectedError):  # its connection is closed, as a client gone
        await client.post("/generate", json={})
    await asyncio.sleep(0.05)
    assert handle.aborted >= 2  # by the backlog limit, then by the skeleton
    assert seen["usage"] is not None
