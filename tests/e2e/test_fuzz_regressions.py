"""Every class of input the fuzzer found wrong, as a named test.

Each case is the smallest body of its class, sent to the app of the tiny
model; the answer must have the fuzzer's property (`fuzzing.check_answer`)
plus what the case itself promises. Add one here for each new finding.
"""

from __future__ import annotations

import json

import pytest

from helpers import wait_idle
from fuzzing import CHAT, COMPLETIONS, Case, check_answer

PERSON_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

REGRESSIONS = {
    # A one-token prompt went in as a decode row, which never forked: with
    # n > 1, choices 1.. never came and the response held a null finish_reason.
    "one-token-prompt-with-n": (
        COMPLETIONS, {"prompt": [200], "n": 3, "max_tokens": 2},
        # (sampled at temperature 1, a choice may also end on EOS)
        lambda body: sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
        and all(c["finish_reason"] in ("length", "stop") for c in body["choices"]),
    ),
    "one-token-prompt-with-n-streamed": (
        COMPLETIONS, {"prompt": [200], "n": 2, "max_tokens": 2, "stream": True}, None,
    ),
    # A temperature that float32 rounds to zero made the logits NaN; with a
    # grammar the sampler then drew a forbidden token: a server_error in the stream.
    "denormal-temperature-with-a-schema": (
        CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 12,
               "temperature": 2.2250738585072014e-308,
               "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": PERSON_A}}},
        lambda body: body["choices"][0]["finish_reason"] == "length"
        or isinstance(json.loads(body["choices"][0]["message"]["content"])["a"], int),
    ),
    "denormal-temperature-streamed": (
        CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 1e-320,
               "stream": True, "response_format": {"type": "json_object"}}, None,
    ),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
async def test_fuzzer_finding(tiny_model, make_client, name):
    route, body, promise = REGRESSIONS[name]
    client = await make_client(tiny_model)
    data = json.dumps({"model": "tiny", **body}).encode()
    response = await client.post(route, data=data, headers={"Content-Type": "application/json"})
    answer = await response.read()
    case = Case("POST", route, data, "application/json", name, body)
    check_answer(case, response.status, dict(response.headers), answer)
    if promise is not None:
        assert promise(json.loads(answer)), answer
    assert (await wait_idle(tiny_model.engine)).kv_pages_used == 0
