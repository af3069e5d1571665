"""What the error-contract tests assert of an answer: an OpenAI-style error
body with the right status, type, code and param; the server still
serving a good request afterwards."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def assert_error(response, status, type_, code=None, param=None):
    assert response.status == status, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.headers.get("x-request-id")
    body = await response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


async def assert_still_serving(client):
    response = await client.post(CHAT, json=GOOD)
    assert response.status == 200, await response.text()
    assert (await response.json())["choices"][0]["message"]["role"] == "assistant"
