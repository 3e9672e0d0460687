"""Tool calling: how tools reach the prompt, how a forced call is constrained, and how a model's tool-call syntax
is parsed back into OpenAI's ``tool_calls``.

Prompt: when the model's chat template knows tools (its source mentions ``tools``), the tool list goes to the
template (transformers' ``apply_chat_template(tools=...)``) and assistant ``tool_calls`` / ``role: tool`` messages
are rendered by it. Otherwise the tools are described in a system message in this documented format
(``FALLBACK_INSTRUCTIONS``): the model is asked to answer a call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; earlier assistant calls are written back in that
same syntax and tool results become user-visible ``<tool_response>`` text.

Constrained choices: ``tool_choice`` naming a function generates the arguments under that function's JSON schema
(structured output), so they always parse and validate; ``"required"`` generates a JSON array of
``{"name", "arguments"}`` objects whose items are one of the tools (``anyOf``), at least one.

``"auto"``: the output is parsed for the formats of the common templates (``ToolCallParser``):
Hermes / Qwen2.5 / Qwen3 ``<tool_call>{...}</tool_call>``, Mistral ``[TOOL_CALLS][{...}, ...]``, and Llama 3.x's
bare JSON ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, several separated by ``;``).
Streaming holds back text that may be the start of a call and emits each call as one ``tool_calls`` delta once it
is complete.
"""
from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from leapdecode.structured.lowering import declared_only

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
MARKERS = (HERMES_OPEN, MISTRAL_MARK, PYTHON_TAG)

FALLBACK_INSTRUCTIONS = (
    "You may call functions to help with the user's request. The available functions, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, each in this exact form:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_for_template(functions: list[Any]) -> list[dict[str, Any]]:
    """OpenAI's tool list as transformers' chat templates take it."""
    return [{"type": "function", "function": _function_dict(f)} for f in functions]


def _function_dict(f: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        d["description"] = f.description
    d["parameters"] = f.parameters if f.parameters is not None else {"type": "object", "properties": {}}
    return d


def fallback_messages(messages: list[dict[str, Any]], functions: list[Any]) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the tool list in a system message, assistant calls
    written as ``<tool_call>`` text, tool results as ``<tool_response>`` user turns."""
    tools_text = "\n".join(json.dumps(_function_dict(f), ensure_ascii=False) for f in functions)
    instructions = FALLBACK_INSTRUCTIONS.format(tools=tools_text)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [f"{HERMES_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                       "arguments": c["function"]["arguments"]},
                                                      ensure_ascii=False) + f"\n{HERMES_CLOSE}" for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


# -- constrained choices ---------------------------------------------------------------------------------------
def _parameters_schema(f: Any) -> dict[str, Any]:
    """A function's parameters schema; with OpenAI's ``strict`` its objects take only the keys they declare
    (``lowering.declared_only``, what a strict json_schema response format does too)."""
    schema = f.parameters if f.parameters else {"type": "object"}
    return declared_only(copy.deepcopy(schema)) if getattr(f, "strict", None) else schema


def named_structured(f: Any) -> dict[str, Any]:
    """The arguments of one named function: an instance of its parameters schema."""
    return {"type": "json_schema", "json_schema": {"name": f.name, "schema": _parameters_schema(f)}}


def required_structured(functions: list[Any], parallel: bool = True) -> dict[str, Any]:
    """At least one call (exactly one when ``parallel`` is false: OpenAI's parallel_tool_calls), each to one of
    the functions with arguments valid for it. The list is the server's own format, parsed back into
    ``tool_calls``, so it is written compact, names first (no model was trained on its whitespace)."""
    items = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": _parameters_schema(f)},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema},
            "whitespace": "compact", "key_order": "schema"}


def parse_required(text: str) -> list[tuple[str, str]]:
    """The (name, arguments JSON) pairs of a ``required_structured`` output."""
    calls = json.loads(text)
    return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


# -- parsing a model's own syntax ------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments: str          # a JSON object's text
    id: str = field(default_factory=tool_call_id)


def _call_from(obj: Any, names: set[str] | None) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in ``text`` (separated by whitespace or ';'), or None if anything else is there."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str, list[ParsedCall]]:
    """(content, calls) of a complete output. Text that is not a well-formed call stays content."""
    if MISTRAL_MARK in text:
        head, _, tail = text.partition(MISTRAL_MARK)
        values = _json_values(tail)
        if values and len(values) == 1 and isinstance(values[0], list):
            calls = [_call_from(v, None) for v in values[0]]
            if calls and all(calls):
                return head.strip(), calls          # type: ignore[return-value]
        return text, []
    if HERMES_OPEN in text:
        content, calls, rest = [], [], text
        while HERMES_OPEN in rest:
            before, _, after = rest.partition(HERMES_OPEN)
            body, closed, rest = after.partition(HERMES_CLOSE)
            values = _json_values(body)
            call = _call_from(values[0], None) if values and len(values) == 1 else None
            if call is None:
                return text, []
            content.append(before)
            calls.append(call)
            if not closed:
                rest = ""
        content.append(rest)
        return "".join(content).strip(), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("{") or body.startswith("["):
        values = _json_values(body)
        if values and len(values) == 1 and isinstance(values[0], list):
            values = values[0]
        if values:
            calls = [_call_from(v, names) for v in values]
            if all(calls):
                return "", calls                   # type: ignore[return-value]
    return text, []


class ToolCallParser:
    """Incremental version of ``parse_tool_calls`` for streaming: ``feed(delta)`` returns (content to send now,
    calls completed now); ``finish()`` flushes what was held back."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.names = names
        self.text = ""            # everything seen
        self.sent = 0             # characters of text already sent as content, or consumed by calls
        self.mode = "content"     # content | hermes | tail (buffer to the end: Mistral / Llama JSON)
        self.calls: list[ParsedCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        out, new_calls = [], []
        while True:
            pending = self.text[self.sent:]
            if self.mode == "tail":
                return "".join(out), new_calls
            if self.mode == "hermes":
                end = pending.find(HERMES_CLOSE)
                if end < 0:
                    return "".join(out), new_calls
                block = pending[:end + len(HERMES_CLOSE)]
                _, calls = parse_tool_calls(block, None)
                if calls:
                    new_calls += calls
                    self.calls += calls
                else:
                    out.append(block)     # not a call after all: it is content
                self.sent += len(block)
                self.mode = "content"
                continue
            # content mode
            if not self.calls and self.sent == 0 and pending.lstrip() and pending.lstrip()[0] in "{[":
                self.mode = "tail"        # the whole output may be a Llama-style JSON call
                continue
            if not self.calls and self.sent == 0 and pending.lstrip().startswith(PYTHON_TAG):
                self.mode = "tail"
                continue
            hit = _first_marker(pending)
            if hit is not None:
                pos, marker = hit
                out.append(pending[:pos])
                self.sent += pos
                self.mode = "hermes" if marker == HERMES_OPEN else "tail"
                continue
            keep = _partial_marker_suffix(pending)
            at_start = not self.calls and self.sent == 0
            if at_start and (not pending.strip() or PYTHON_TAG.startswith(pending.lstrip())):
                keep = len(pending)       # leading whitespace or part of <|python_tag|>: wait and see
            send = pending[:len(pending) - keep]
            out.append(send)
            self.sent += len(send)
            return "".join(out), new_calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        pending = self.text[self.sent:]
        self.sent = len(self.text)
        if not pending:
            return "", []
        if self.mode == "content":
            return pending, []
        content, calls = parse_tool_calls(pending, self.names)
        self.calls += calls
        return content, calls


def _first_marker(text: str) -> tuple[int, str] | None:
    hits = [(text.find(m), m) for m in (HERMES_OPEN, MISTRAL_MARK) if m in text]
    return min(hits) if hits else None


def _partial_marker_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker (held back for now)."""
    best = 0
    for m in (HERMES_OPEN, MISTRAL_MARK):
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


# -- OpenAI's message and delta shapes ---------------------------------------------------------------------------
def assistant_message(c: Any, mode: str | None, names: set[str], legacy: bool) -> tuple[Any, str | None]:
    """The chat message and finish reason of one finished choice under tool choice ``mode`` (None or "none": no
    tools; "auto"; "required"; a function's name). ``legacy``: the request used ``functions``."""
    from leapdecode.server.protocol import AssistantMessage, FunctionCallOut, ToolCallOut

    finish = c.finish_reason
    text = c.text
    calls: list[ParsedCall] = []
    content: str | None = text
    if mode in (None, "none"):
        return AssistantMessage(content=text), finish
    if mode == "auto":
        content, calls = parse_tool_calls(text, names)
    elif mode == "required":
        try:
            calls = [ParsedCall(name, args) for name, args in parse_required(text)]
            content = None
        except (ValueError, KeyError, TypeError):       # cut short by max_tokens: not a complete call
            calls = []
    else:
        calls = [ParsedCall(mode, text)]
        content = None
    if not calls:
        return AssistantMessage(content=content), finish
    if legacy:
        first = calls[0]
        return (AssistantMessage(content=content or None,
                                 function_call=FunctionCallOut(name=first.name, arguments=first.arguments)),
                "function_call" if finish == "stop" else finish)
    message = AssistantMessage(content=content or None, tool_calls=[
        ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
        for call in calls])
    # OpenAI answers a forced named call with "stop", a call the model chose (or "required") with "tool_calls".
    if finish == "stop" and mode in ("auto", "required"):
        finish = "tool_calls"
    elif finish == "stop" and legacy:
        finish = "function_call"
    return message, finish


class ToolStream:
    """One streamed choice's deltas under a tool choice: content deltas, and ``tool_calls`` deltas (a call's id,
    type and name in its first delta, its arguments in that one or later ones)."""

    def __init__(self, mode: str, names: set[str], legacy: bool) -> None:
        self.mode, self.names, self.legacy = mode, names, legacy
        self.parser = ToolCallParser(names)
        self.buffer = ""
        self.num_calls = 0
        self.named_id = tool_call_id()

    def _call_deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": self.num_calls, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
            self.num_calls += 1
        return out

    def step(self, text: str, c: Any) -> tuple[dict[str, Any], str | None]:
        """(delta, finish_reason override or None) for new text ``text`` of choice ``c``."""
        delta: dict[str, Any] = {}
        finish = None
        if self.mode not in ("auto", "required"):                     # a named function: stream its arguments
            if text or not self.num_calls:
                if not self.num_calls:
                    self.num_calls = 1
                    call = {"index": 0, "id": self.named_id, "type": "function",
                            "function": {"name": self.mode, "arguments": text}}
                else:
                    call = {"index": 0, "function": {"arguments": text}}
                delta = self._legacy(call) if self.legacy else {"tool_calls": [call]}
            if c.finished and c.finish_reason == "stop" and self.legacy:
                finish = "function_call"
            return delta, finish
        if self.mode == "required":
            self.buffer += text
            if c.finished:
                try:
                    calls = [ParsedCall(n, a) for n, a in parse_required(self.buffer)]
                except (ValueError, KeyError, TypeError):
                    return ({"content": self.buffer} if self.buffer else {}), None
                delta = self._deltas("", calls)
                finish = "tool_calls" if c.finish_reason == "stop" else None
            return delta, finish
        content, calls = self.parser.feed(text)
        if c.finished:
            more, late = self.parser.finish()
            content, calls = content + more, calls + late
        delta = self._deltas(content, calls)
        if c.finished and c.finish_reason == "stop" and self.num_calls:
            finish = "function_call" if self.legacy else "tool_calls"
        return delta, finish

    def _deltas(self, content: str, calls: list[ParsedCall]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            if self.legacy:
                first = calls[0] if not self.num_calls else None
                self.num_calls += len(calls)
                if first is not None:
                    delta.update(self._legacy({"function": {"name": first.name, "arguments": first.arguments}}))
            else:
                delta["tool_calls"] = self._call_deltas(calls)
        return delta

    @staticmethod
    def _legacy(call: dict[str, Any]) -> dict[str, Any]:
        return {"function_call": {k: v for k, v in call["function"].items()}}
