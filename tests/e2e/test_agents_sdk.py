"""The OpenAI Agents SDK's default model class (`OpenAIResponsesModel`, the
Responses API) runs a one-tool agent for three turns against the server on
the default model."""

from __future__ import annotations

import json

import pytest


import agents  # noqa: E402  (openai-agents, in the test extra)

pytestmark = [pytest.mark.default_model, pytest.mark.slow]

WEATHER = {"paris": "18 C, cloudy", "oslo": "4 C, snow", "lima": "22 C, sunny"}


async def test_an_agent_with_one_tool_runs_three_turns(default_model, make_openai):
    client = await make_openai(default_model)
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return WEATHER.get(city.lower(), "unknown city")

    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=120),
        # the tool's result is the answer: the 135M model's own prose after a
        # tool result tends to run past max_tokens
        tool_use_behavior="stop_on_first_tool",
    )
    conversation = []
    for question in ("What is the weather in Paris?", "And in Oslo?", "What about Lima?"):
        result = await agents.Runner.run(agent, [*conversation, {"role": "user", "content": question}], max_turns=4)
        made = [item.raw_item for item in result.new_items if type(item).__name__ == "ToolCallItem"]
        assert made and all(json.loads(call.arguments) for call in made)
        assert result.final_output in WEATHER.values() or result.final_output == "unknown city"
        conversation = result.to_input_list()
    assert len(calls) >= 3
