"""The OpenAI Agents SDK against lockgate: its default model class
(`OpenAIResponsesModel`, the Responses API), one function tool, three turns.

    lockgate serve &
    pip install openai-agents
    python examples/agents_sdk.py           # or --base-url http://HOST:PORT/v1
"""

from __future__ import annotations

import argparse
import asyncio

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

WEATHER = {"paris": "18 C, cloudy", "oslo": "4 C, snow", "lima": "22 C, sunny"}


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return WEATHER.get(city.lower(), "unknown city")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    set_tracing_disabled(True)  # traces go to OpenAI's servers otherwise
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused")
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=args.model, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=120),
        # the tool's result is the answer (a 135M model's prose after a tool
        # result tends to run on past max_tokens)
        tool_use_behavior="stop_on_first_tool",
    )
    conversation = []
    for question in ("What is the weather in Paris?", "And in Oslo?", "What about Lima?"):
        print(f"user: {question}")
        result = await Runner.run(agent, [*conversation, {"role": "user", "content": question}], max_turns=4)
        for item in result.new_items:
            if type(item).__name__ == "ToolCallItem":
                print(f"  agent calls {item.raw_item.name}({item.raw_item.arguments})")
        print(f"agent: {result.final_output}")
        conversation = result.to_input_list()


if __name__ == "__main__":
    asyncio.run(main())
