"""Tool calling: the parsers of the common templates' tool-call syntax (batch and streaming), and the server end to
end with the official openai client: forced calls (named, "required") generated under the tools' schemas, auto
calls parsed from the output (the output pinned with guided_choice, since the tiny model calls nothing by
itself), streaming deltas of tool_calls, tool results in the history, the legacy functions API, and templates
with and without tool support."""
from __future__ import annotations

import json
import os
import shutil

import httpx
import jsonschema
import openai
import pytest

from leapdecode.server import build_app
from leapdecode.server.tools import ToolCallParser, parse_tool_calls
from test_server import MODEL, assert_pool_free, one_torch_thread, serve, tiny_llm, wait_idle  # noqa: F401

CONTEXT = 2048          # the fallback tool prompt is long in the tiny 384-token vocabulary
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "Weather in Paris?"}]


# -- parsers ---------------------------------------------------------------------------------------------------
PARSE_CASES = [
    # (text, expected content, expected [(name, arguments)])
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "", [("f", {"a": 1})]),
    ('Let me check.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {}}</tool_call>', "Let me check.", [("f", {"a": 1}), ("g", {})]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "x"}}, {"name": "g", "arguments": {"b": 2}}]', "",
     [("f", {"a": "x"}), ("g", {"b": 2})]),
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),                       # Llama 3.x
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ('{"name": "unknown_tool", "parameters": {}}', '{"name": "unknown_tool", "parameters": {}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),                                               # plain JSON content
    ('<tool_call>{"name": "f", "arguments": {broken</tool_call>',
     '<tool_call>{"name": "f", "arguments": {broken</tool_call>', []),
    ("Just text, no calls.", "Just text, no calls.", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
]


@pytest.mark.parametrize("text,content,calls", PARSE_CASES)
def test_parse_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, {"f", "g"})
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("text,content,calls", PARSE_CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streaming_parser_matches_batch(text, content, calls, piece):
    parser = ToolCallParser({"f", "g"})
    out, got = "", []
    for i in range(0, len(text), piece):
        c, new = parser.feed(text[i:i + piece])
        out, got = out + c, got + new
        assert "<tool_c" not in c or not calls      # a call's markup is never sent as content
    c, new = parser.finish()
    out, got = out + c, got + new
    assert out.strip() == content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_streaming_parser_sends_content_before_a_call_early():
    parser = ToolCallParser({"f"})
    assert parser.feed("Hello there. ") == ("Hello there. ", [])
    content, calls = parser.feed("<tool_")                     # may be the start of a call: held back
    assert content == "" and calls == []
    content, calls = parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "" and [c.name for c in calls] == ["f"]


# -- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tsrv(llama_dir):
    app = build_app(tiny_llm(llama_dir, max_model_len=CONTEXT), served_model_name=MODEL)
    with serve(app) as (url, _):
        yield url, app


@pytest.fixture(scope="module")
def client(tsrv):
    return openai.OpenAI(base_url=tsrv[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_tool_choice_is_valid_under_the_schema(client, seed):
    r = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=64, seed=seed, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "get_weather"
    _check_call(msg.tool_calls[0])
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_calls_at_least_one_tool(client, seed):
    """parallel_tool_calls=false: exactly one call (the random model would otherwise add calls until
    max_tokens)."""
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                       max_tokens=200, seed=seed, temperature=1.0, parallel_tool_calls=False)
    choice = r.choices[0]
    assert len(choice.message.tool_calls) == 1
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        _check_call(call)


def test_named_tool_call_streams_argument_deltas(client):
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=64, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert finish == "stop"


def test_named_tool_call_streams_with_n_2(client):
    args = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=64, n=2,
                                                seed=5, temperature=1.0, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_time"}}):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                args[ch.index] += d.function.arguments or ""
    for text in args.values():
        jsonschema.validate(json.loads(text), TIME)


def test_required_tool_calls_stream(client):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                                max_tokens=200, seed=3, temperature=1.0, stream=True,
                                                parallel_tool_calls=False):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert calls and finish == "tool_calls"
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


AUTO_OUTPUT = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')


def test_auto_parses_the_models_calls(client):
    """tool_choice auto: the model's own <tool_call> syntax becomes tool_calls (parallel calls included), in the
    whole response and in streamed deltas. The output is pinned with guided_choice."""
    kw = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=200, extra_body={"guided_choice": [AUTO_OUTPUT]})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, []).append(d)
            finish = ch.finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert [(ds[0].function.name, json.loads("".join(d.function.arguments for d in ds)))
            for ds in calls.values()] == [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {"zone": "CET"})]


def test_auto_without_a_call_is_plain_content(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None


def test_tool_results_in_the_history(tsrv, client):
    """An assistant turn with tool_calls and the tool's result render into the prompt (fallback format here: the
    test template knows no tools), and the conversation goes on."""
    url, app = tsrv
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with httpx.Client(base_url=url, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "sunny, 21 C" in text and '"get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text
    wait_idle(app)
    assert_pool_free(app)


def test_legacy_functions(client):
    functions = [t["function"] for t in TOOLS]
    r = client.chat.completions.create(model=MODEL, messages=USER, functions=functions, max_tokens=64,
                                       function_call={"name": "get_time"})
    msg = r.choices[0].message
    assert msg.function_call.name == "get_time" and not msg.tool_calls
    jsonschema.validate(json.loads(msg.function_call.arguments), TIME)
    assert r.choices[0].finish_reason == "function_call"


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}CALL {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if greeting is defined %}{{ greeting }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_template_dir(llama_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tooltpl") / "model")
    shutil.copytree(llama_dir, path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TOOL_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    for name in ("chat_template.jinja",):
        if os.path.exists(os.path.join(path, name)):
            with open(os.path.join(path, name), "w") as f:
                f.write(TOOL_TEMPLATE)
    return path


def test_template_with_tools_renders_them(tool_template_dir):
    """A template that knows tools gets them (and assistant tool_calls with arguments as objects) through
    apply_chat_template(tools=...); chat_template_kwargs reach the template too."""
    app = build_app(tiny_llm(tool_template_dir, max_model_len=CONTEXT), served_model_name=MODEL)
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    with serve(app) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": history, "tools": TOOLS,
                                           "chat_template_kwargs": {"greeting": "HELLO"}}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "TOOLS: get_weather get_time" in text and "<tools>" not in text
        assert 'CALL get_time {"zone": "UTC"}' in text and "12:00" in text and "HELLO" in text
        r = http.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 40,
                                                    "tool_choice": {"type": "function",
                                                                    "function": {"name": "get_weather"}}})
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_strict_function_arguments_take_only_declared_keys(client):
    """A function defined with OpenAI's ``strict: true``: its arguments are an instance of its parameters with
    their objects closed (the random model, free to, writes other keys into an open object, and may run out of
    tokens there: the open form's keys are read from its text)."""
    import copy
    import re
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    closed = copy.deepcopy(params) | {"additionalProperties": False}
    extra = 0
    for seed in range(4):
        for strict in (False, True):
            tool = {"type": "function", "function": {"name": "get_weather", "parameters": params, "strict": strict}}
            r = client.chat.completions.create(
                model=MODEL, messages=USER, tools=[tool], max_tokens=96, seed=seed, temperature=1.0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            text = r.choices[0].message.tool_calls[0].function.arguments
            if strict:
                jsonschema.validate(json.loads(text), closed)
            else:
                extra += len(set(re.findall(r'"((?:[^"\\]|\\.)*)"\s*:', text)) - {"city"})
    assert extra > 0        # the open form did take other keys: strict is what kept them out
