"""A tool-using agent written with the plain openai SDK: a weather tool and a
calculator, three user turns, every call run and its result sent back, until
the model answers in text.

    lockgate serve &                      # the default model
    python examples/agent_loop.py         # or --base-url http://HOST:PORT/v1
"""

from __future__ import annotations

import argparse
import ast
import json
import operator

from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
WEATHER = {"paris": "18 C, cloudy", "oslo": "4 C, snow", "lima": "22 C, sunny"}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.Pow: operator.pow}


def calculate(expression: str) -> str:
    """Arithmetic only: numbers and + - * / ** and parentheses."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def run_tool(name: str, arguments: dict) -> str:
    if name == "get_weather":
        return WEATHER.get(str(arguments.get("city", "")).lower(), "unknown city")
    if name == "calculate":
        return calculate(str(arguments.get("expression", "")))
    return f"error: no tool {name}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."}]
    for question in ("What is the weather in Paris?", "What is 12 * (3 + 4)?", "And the weather in Oslo?"):
        print(f"user: {question}")
        messages.append({"role": "user", "content": question})
        for step in range(4):
            # the model decides; a last step must answer in text
            choice = "auto" if step < 3 else "none"
            reply = client.chat.completions.create(
                model=args.model, messages=messages, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False, max_tokens=96, temperature=0,
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                print(f"assistant: {message.content}")
                break
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)  # every call parses
                result = run_tool(call.function.name, arguments)
                print(f"assistant calls {call.function.name}({call.function.arguments}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
