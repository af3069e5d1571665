"""The built-in tool-call formats read their family's outputs, whole and
streamed (split at every character), and write grammars llguidance
compiles. The recorded outputs follow each format's documentation."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lockgate.plugin_api.grammars import compile_grammar
from lockgate.plugin_api.tool_calls import Tool
from lockgate.plugins.tool_formats import BUILT_IN_FORMATS, format_for_template

WEATHER = Tool(
    "get_weather", "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
     "required": ["city"]},
)
ADD = Tool("add", None, {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                          "required": ["a", "b"]})

#: (format, model output, expected content, expected calls as (name, arguments))
RECORDED = [
    ("generic", '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}',
     None, [("get_weather", {"city": "Paris"})]),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}',
     None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo", "unit": "c"})]),
    ("generic", '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}', None, [("add", {"a": 1, "b": 2})]),
    ("generic", '{"response": "It is sunny in Paris."}', "It is sunny in Paris.", []),
    ("generic", "Just some text.", "Just some text.", []),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "argum',  # cut short
     None, [("add", {"a": 1, "b": 2})]),
    ("generic", '{"response": "It is 4 \\u00b0C and sn', "It is 4 \u00b0C and sn", []),  # cut short
    ("generic", '{"', None, []),  # cut before anything was whole (max_tokens 1)
    ("generic", '{"tool_calls": [{"name": "add", "argu', None, []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "Let me check.", [("add", {"a": 2, "b": 3}), ("get_weather", {"city": "Rome"})]),
    ("hermes", "The answer is 5.", "The answer is 5.", []),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}',  # cut at max_tokens
     None, [("add", {"a": 1, "b": 1})]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}', None, [("add", {"a": 4, "b": 5})]),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}',
     None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("llama3", "It is 12 degrees.", "It is 12 degrees.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     None, [("get_weather", {"city": "Paris"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "add", "arguments": {"a": 3, "b": 4}}]',
     None, [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}', None, [("get_weather", {"city": "Lima"})]),
    ("mistral", "No tools needed [really].", "No tools needed [really].", []),
    ("qwen3-coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", None, [("get_weather", {"city": "Paris"})]),
    ("qwen3-coder", "Let me check.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n"
                    "3.5\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nSan Jose,\nCA\n</parameter>\n<parameter=unit>\nf\n</parameter>\n</function>\n"
                    "</tool_call>",
     "Let me check.", [("add", {"a": 2, "b": 3.5}), ("get_weather", {"city": "San Jose,\nCA", "unit": "f"})]),
    ("qwen3-coder", "The answer is 5.", "The answer is 5.", []),
    ("qwen3-coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n", None, []),  # cut short
    ("qwen3-coder", "<tool_call>\n", None, []),
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
     None, [("get_weather", {"city": "Paris"})]),
    ("gemma4", 'Let me check.<|tool_call>call:add{a:2,b:3.5}<tool_call|><|tool_call>call:get_weather{city:<|"|>Oslo, '
               'Norway<|"|>,unit:<|"|>c<|"|>}<tool_call|>',
     "Let me check.", [("add", {"a": 2, "b": 3.5}), ("get_weather", {"city": "Oslo, Norway", "unit": "c"})]),
    ("gemma4", '<|tool_call>call:add{"a": 1, "b": 2}<tool_call|>', None, [("add", {"a": 1, "b": 2})]),  # its grammar's
    ("gemma4", "It is 12 degrees.", "It is 12 degrees.", []),
    ("gemma4", "<|tool_call>call:add{a:1,b:", None, []),  # cut short
]


#: the call ids a format makes, where they are not OpenAI's `call_` and 24 hex digits
ID_SHAPES = {"mistral": "[A-Za-z0-9]{9}"}


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("name, output, content, calls", RECORDED)
def test_a_whole_output_is_read(name, output, content, calls):
    parsed = BUILT_IN_FORMATS[name]().parse(output)
    assert parsed.content == content
    assert calls_of(parsed) == calls
    assert all(re.fullmatch(ID_SHAPES.get(name, "call_[0-9a-f]{24}"), c.id) for c in parsed.calls)


@pytest.mark.parametrize("name, output, content, calls", RECORDED)
def test_a_streamed_output_split_anywhere_reads_the_same(name, output, content, calls):
    for cut in range(len(output) + 1):
        stream = BUILT_IN_FORMATS[name]().stream()
        sent = stream.feed(output[:cut]) + stream.feed(output[cut:])
        end = stream.finish()
        assert (sent + (end.content or "")).strip() == (content or ""), cut
        assert calls_of(end) == calls, cut
        if calls:  # nothing of a call leaks out as text
            assert "{" not in sent and "tool_call" not in sent, cut


def test_mistral_keeps_an_id_it_wrote_and_maps_others_the_same_way_each_time():
    fmt = BUILT_IN_FORMATS["mistral"]()
    # Nemo's template shows the model its calls' ids after the arguments
    [call] = fmt.parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "aZ3kq9Pw0"}]').calls
    assert call.id == "aZ3kq9Pw0"
    [call] = fmt.parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "call_1"}]').calls
    assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
    # ids of other shapes sent back in history reach the template in its shape
    assert fmt.template_call_id("aZ3kq9Pw0") == "aZ3kq9Pw0"
    mapped = {fmt.template_call_id(f"call_{i:024x}") for i in range(1000)}
    assert len(mapped) == 1000 and all(re.fullmatch("[A-Za-z0-9]{9}", m) for m in mapped)
    assert fmt.template_call_id("call_0") == BUILT_IN_FORMATS["mistral"]().template_call_id("call_0")
    assert BUILT_IN_FORMATS["hermes"]().template_call_id("call_0") == "call_0"


def test_text_streams_out_as_it_comes():
    stream = BUILT_IN_FORMATS["hermes"]().stream()
    assert stream.feed("The answer") == "The answer"
    assert stream.feed(" is <tool") == " is "  # held: may be a call's start
    assert stream.feed("box>.") == "<toolbox>."


@pytest.mark.parametrize(
    "template, name",
    [("{{ '<tool_call>' }}", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"),
     ("{{- '<tool_call>\\n<function=' + name + '>\\n' }}{{- '<parameter=' + key }}", "qwen3-coder"),
     ("{{- '<|tool_call>call:' + function['name'] + '{' -}}", "gemma4"),
     ("{% for m in messages %}{{ m.content }}{% endfor %}", "generic"), (None, "generic")],
)
def test_the_format_follows_the_template(template, name):
    assert format_for_template(template) == name


@pytest.mark.parametrize("name", sorted(BUILT_IN_FORMATS))
@pytest.mark.parametrize("max_calls", [1, 16])
def test_every_required_grammar_compiles_and_forces_a_valid_call(name, max_calls, smollm2_tokenizer):
    fmt = BUILT_IN_FORMATS[name]()
    text = fmt.grammar([WEATHER, ADD], required=True, max_calls=max_calls)
    grammar = compile_grammar(text, smollm2_tokenizer)
    # walk the grammar greedily through one valid call, as a model would
    call = RECORDED_CALL[name]
    matcher = grammar.matcher()
    for token in smollm2_tokenizer.encode(call, add_special_tokens=False):
        matcher.accept(token)
    assert matcher.is_accepting
    parsed = fmt.parse(call)
    for c in parsed.calls:
        jsonschema.validate(json.loads(c.arguments), {"add": ADD, "get_weather": WEATHER}[c.name].parameters)


#: one call in each format, for the grammar walk
RECORDED_CALL = {
    "generic": '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    "qwen3-coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                   "</function>\n</tool_call>",
    "gemma4": '<|tool_call>call:add{"a": 1, "b": 2}<tool_call|>',
}


#: the same call with `a` a word where the tool's schema asks for a number
BAD_CALL = {name: call.replace('"a": 1', '"a": "one"') for name, call in RECORDED_CALL.items()}
BAD_CALL["qwen3-coder"] = RECORDED_CALL["qwen3-coder"].replace("<parameter=a>\n1\n", "<parameter=a>\none\n")


@pytest.mark.parametrize("name", sorted(BUILT_IN_FORMATS))
def test_a_call_its_tools_schema_refuses_is_refused_by_the_grammar(name, smollm2_tokenizer):
    fmt = BUILT_IN_FORMATS[name]()
    grammar = compile_grammar(fmt.grammar([WEATHER, ADD], required=True, max_calls=1), smollm2_tokenizer)
    bad = BAD_CALL[name]
    assert bad != RECORDED_CALL[name]
    matcher = grammar.matcher()
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        for token in smollm2_tokenizer.encode(bad, add_special_tokens=False):
            matcher.accept(token)


def test_qwen3_coder_reads_each_value_by_its_tools_schema():
    tool = Tool("find", None, {"type": "object", "properties": {
        "zip": {"type": "string"}, "n": {"type": ["integer", "string"]}, "tags": {"type": "array"},
        "on": {"$ref": "#/$defs/Flag"}}, "$defs": {"Flag": {"type": "boolean"}}})
    output = ("<tool_call>\n<function=find>\n" + "".join(
        f"<parameter={key}>\n{value}\n</parameter>\n"
        for key, value in [("zip", "02134"), ("n", "7"), ("tags", '["a", "b"]'), ("on", "true")]
    ) + "</function>\n</tool_call>")
    [call] = BUILT_IN_FORMATS["qwen3-coder"]().with_tools([tool]).parse(output).calls
    assert json.loads(call.arguments) == {"zip": "02134", "n": 7, "tags": ["a", "b"], "on": True}
    [call] = BUILT_IN_FORMATS["qwen3-coder"]().with_tools([tool]).parse(output.replace("\n7\n", "\nseven\n")).calls
    assert json.loads(call.arguments)["n"] == "seven"
    # with no schema, text that reads as JSON other than a string is JSON
    [call] = BUILT_IN_FORMATS["qwen3-coder"]().parse(output.replace("02134", "12345")).calls
    assert json.loads(call.arguments) == {"zip": 12345, "n": 7, "tags": ["a", "b"], "on": True}


def test_qwen3_coder_grammar_takes_any_parameters_for_an_object_without_properties(smollm2_tokenizer):
    free, empty = Tool("free", None, {"type": "object"}), Tool("empty", None, {"type": "object", "properties": {}})
    grammar = compile_grammar(
        BUILT_IN_FORMATS["qwen3-coder"]().grammar([free, empty], required=True, max_calls=1), smollm2_tokenizer
    )

    def accepts(text):
        matcher = grammar.matcher()
        try:
            for token in smollm2_tokenizer.encode(text, add_special_tokens=False):
                matcher.accept(token)
        except ValueError:
            return False
        return matcher.is_accepting

    parameter = "<parameter=x>\nhi\n</parameter>\n"
    assert accepts(f"<tool_call>\n<function=free>\n{parameter}</function>\n</tool_call>")
    assert accepts("<tool_call>\n<function=empty>\n</function>\n</tool_call>")
    assert not accepts(f"<tool_call>\n<function=empty>\n{parameter}</function>\n</tool_call>")


def test_qwen3_coder_streams_a_call_that_lacks_its_tool_call_tag_by_the_tools_names():
    # Qwen3-Coder sometimes leaves out <tool_call>; as llama.cpp, the bare
    # tag starts a call only with an offered tool's name
    fmt = BUILT_IN_FORMATS["qwen3-coder"]().with_tools([ADD])
    stream = fmt.stream()
    sent = stream.feed("Sure.\n<function=ad") + stream.feed("d>\n<parameter=a>\n1\n</parameter>\n</function>")
    assert sent == "Sure.\n"
    assert calls_of(stream.finish()) == [("add", {"a": 1})]
    other = fmt.stream()
    assert other.feed("#include <functional>") == "#include <functional>"
