"""Request and response models of the OpenAI-compatible API (pydantic v2).

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument supplied"), so a typo never turns
into a silently ignored setting. Fields that OpenAI defines but this server cannot honour yet are declared anyway
and rejected with a clear 400 when they are actually used (see ``unsupported_fields``); fields that only carry
bookkeeping for OpenAI's platform (``user``, ``store``, ``metadata``, ...) are accepted and ignored.

The vLLM-style extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``guided_*``, ``structured_outputs``, ``prompt_logprobs``, ...) are accepted on both endpoints
with vLLM's names and meanings; the ``openai`` client sends them via ``extra_body``.

Types are strict, as OpenAI's are: ``"max_tokens": "16"`` is a 400, not 16 (pydantic strict mode; a JSON integer
is still a valid float). Integers are bounded where the engine would otherwise meet them unchecked (top_k,
max_tokens, min_tokens, token ids); bounds that depend on the model (the vocabulary, the context) are checked by
the handler (``app.OpenAIServer.check_request``). Strings holding a lone UTF-16 surrogate (JSON ``"\ud800"``),
which no tokenizer can encode, are refused here with a 400 naming the field.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from leapdecode.sampling_params import MIN_REPETITION_PENALTY, MIN_TOP_P

# OpenAI's own limit on ``n``; it also keeps one request from monopolising the KV pool.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1          # bound of counts and token ids before the model-specific checks
MAX_LOGIT_BIAS = 300           # OpenAI's limit on logit_bias entries


def field_error(param: str, message: str) -> PydanticCustomError:
    """A cross-field validation error that still names its field (the 400 body's ``param``)."""
    return PydanticCustomError("invalid_field", message, {"param": param})


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (or dict key) holding a lone surrogate, which UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or None
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and find_surrogate(k, sub) is not None:
                return path or None
            found = find_surrogate(v, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = find_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class StrictModel(BaseModel):
    """Base of every request model: unknown fields are errors, NaN/Infinity are not numbers, no coercion of
    strings into numbers or booleans."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class RootRequest(StrictModel):
    """A whole request body: refuses lone surrogates anywhere in it, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _no_surrogates(cls, data: Any) -> Any:
        where = find_surrogate(data)
        if where is not None:
            raise field_error(where, "strings must be valid Unicode (a lone UTF-16 surrogate cannot be encoded)")
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True, strict=True)


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_needed(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("response_format.json_schema",
                              "response_format.json_schema is required when type is 'json_schema'")
        return self

    def to_structured(self) -> dict[str, Any] | None:
        """The engine's ``SamplingParams.structured`` takes OpenAI's response_format shape as is."""
        if self.type == "text":
            return None
        return self.model_dump(by_alias=True, exclude_none=True)


# -- vLLM's structured-output extras ----------------------------------------------------------------------------
class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` object: exactly one of these constraints."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None      # accepted, ignored (the grammar decides whitespace)
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True, strict=True)

    def to_structured(self) -> dict[str, Any]:
        return guided_to_structured(self.json_, self.regex, self.choice, self.grammar, bool(self.json_object),
                                    "structured_outputs")


def guided_to_structured(json_: Any, regex: str | None, choice: list[str] | None, grammar: str | None,
                         json_object: bool, where: str) -> dict[str, Any] | None:
    """vLLM's guided_* / structured_outputs fields -> the engine's ``SamplingParams.structured`` dict."""
    import json as _json
    given = [k for k, v in (("json", json_), ("regex", regex), ("choice", choice), ("grammar", grammar),
                            ("json_object", json_object or None)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{where}: only one kind of constraint is allowed, got {given}")
    if not given:
        return None
    if json_ is not None:
        schema = json_
        if isinstance(schema, str):
            try:
                schema = _json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"{where}: the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"{where}: the JSON schema must be an object")
        return {"type": "json_schema", "json_schema": {"name": "guided", "schema": schema}}
    if regex is not None:
        return {"type": "regex", "regex": regex}
    if choice is not None:
        return {"type": "choice", "choice": list(choice)}
    if grammar is not None:
        return {"type": "grammar", "grammar": grammar}
    return {"type": "json_object"}


# -- the sampling fields both endpoints share ------------------------------------------------------------------
class SamplingFields(RootRequest):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    # Lower bounds keep the sampler's float32 arithmetic finite: a top_p or repetition_penalty that rounds to 0
    # in float32 (1e-300) would make a NaN distribution.
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)          # and <= the vocabulary (handler)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)   # each within the vocabulary (handler)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None    # accepted; the tokenizer's own decoding decides
    include_stop_str_in_output: bool = False
    # Decoding strategies (leapdecode extras; see the README): Mirostat (llama.cpp's names), contrastive search
    # (transformers' penalty_alpha with top_k), DoLa (transformers' dola_layers).
    mirostat: int | None = Field(None, ge=0, le=2)
    mirostat_tau: float | None = Field(None, gt=0.0, le=100.0)
    mirostat_eta: float | None = Field(None, gt=0.0, le=10.0)
    penalty_alpha: float | None = Field(None, ge=0.0, le=1.0)
    dola_layers: Literal["low", "high"] | list[int] | None = Field(None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None          # accepted, ignored: one grammar backend here
    structured_outputs: StructuredOutputs | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32_MAX)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # accepted, ignored: the scheduler is first-come
    use_beam_search: bool = False                         # beam width: best_of (completions) or n
    length_penalty: float = Field(1.0, ge=-100.0, le=100.0)   # beam search only, transformers' meaning
    early_stopping: bool = False                               # beam search only
    request_id: str | None = Field(None, max_length=256)
    # Accepted and ignored: bookkeeping for OpenAI's platform, meaningless here.
    user: str | None = None
    # Keys are token ids in the vocabulary (checked by the app, which knows it), values in [-100, 100].
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= t <= INT32_MAX for t in v):
            raise ValueError("stop_token_ids must be token ids (non-negative integers in the vocabulary)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids as strings, got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        constraints = [name for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                         "guided_choice", "guided_grammar")
                       if getattr(self, name) is not None
                       and not (name == "response_format" and self.response_format.type == "text")]
        if len(constraints) > 1:
            raise field_error(constraints[1], f"only one output constraint is allowed, got {constraints}")
        return self

    def unsupported_fields(self) -> list[str]:
        """Fields that were set to something this server cannot do; the handler turns them into a 400."""
        return []

    def structured(self) -> tuple[dict[str, Any] | None, str | None]:
        """The output constraint (the engine's ``structured`` dict) and the request field it came from."""
        if self.response_format is not None:
            return self.response_format.to_structured(), "response_format"
        if self.structured_outputs is not None:
            return self.structured_outputs.to_structured(), "structured_outputs"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                kw = {"json_": None, "regex": None, "choice": None, "grammar": None,
                      name.removeprefix("guided_").replace("json", "json_"): getattr(self, name)}
                return guided_to_structured(kw["json_"], kw["regex"], kw["choice"], kw["grammar"], False,
                                            name), name
        return None, None

    def sampling_kwargs(self) -> dict[str, Any]:
        """Fields that map one to one onto SamplingParams (only those the client set, so model defaults apply)."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "mirostat",
                 "mirostat_tau", "mirostat_eta", "penalty_alpha", "dola_layers")
        kw = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:
            kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        structured, _ = self.structured()
        if structured is not None:
            kw["structured"] = structured
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# -- /v1/completions -------------------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)   # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True                       # vLLM: the tokenizer's BOS etc. on a text prompt

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and v and isinstance(v[0], int):
            if any(t < 0 or t > INT32_MAX for t in v):
                raise ValueError("prompt token ids must be non-negative integers in the vocabulary")
            return v                                      # one prompt of token ids, however many
        if isinstance(v, list) and len(v) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts per request")
        if isinstance(v, list) and v and isinstance(v[0], list):
            for ids in v:
                if not ids:
                    raise ValueError("a prompt of token ids must not be empty")
                if any(t < 0 or t > INT32_MAX for t in ids):
                    raise ValueError("prompt token ids must be non-negative integers in the vocabulary")
        return v

    @model_validator(mode="after")
    def _check_counts(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise field_error("best_of", "best_of must be >= n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise field_error("best_of", "best_of > n cannot be streamed")
        if max(self.n, self.best_of or 1) * len(self.prompts()) > MAX_N:
            raise field_error("n", f"n (or best_of) times the number of prompts must be at most {MAX_N}")
        return self

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        return bad

    def prompts(self) -> list[str | list[int]]:
        """One request may carry several prompts: a string, a list of strings, token ids, or lists of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# -- /v1/chat/completions --------------------------------------------------------------------------------------
class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    """Declared only so that an image gets a clear 'not supported' instead of a type error."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file"]


FUNCTION_NAME = r"^[A-Za-z0-9_.:-]{1,64}$"


class FunctionDef(StrictModel):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(StrictModel):
    name: str
    arguments: str


class ToolCallIn(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: FunctionCallIn | None = None
    refusal: str | None = None                  # accepted on assistant messages echoed back; ignored

    @model_validator(mode="after")
    def _content_needed(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"a '{self.role}' message needs content")
        return self

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        return content or ""

    def to_template(self) -> dict[str, Any]:
        """The plain dict a Hugging Face chat template expects (content parts joined into one string; tool call
        arguments as objects, which is what tool-aware templates render with ``tojson``)."""
        import json as _json
        # Few templates know OpenAI's newer "developer" role; it means what "system" means to them. The legacy
        # "function" role is a tool result.
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        msg: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        calls = list(self.tool_calls or [])
        if self.function_call is not None:
            calls.append(ToolCallIn(function=self.function_call))
        if calls:
            out = []
            for call in calls:
                try:
                    args: Any = _json.loads(call.function.arguments)
                except ValueError:
                    args = call.function.arguments
                out.append({"id": call.id, "type": "function",
                            "function": {"name": call.function.name, "arguments": args}})
            msg["tool_calls"] = out
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)   # deprecated by OpenAI in favour of the next one
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM extras.
    continue_final_message: bool = False
    add_special_tokens: bool = False          # the chat template already has the special tokens it wants
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted and ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    # Tool calling (see tools.py).
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionDef] | None = Field(None, max_length=128)
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # Declared so the error says "not supported"; see unsupported_fields().
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.tools is not None and self.functions is not None:
            raise field_error("functions", "send either tools or the legacy functions, not both")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise field_error("continue_final_message", "continue_final_message needs add_generation_prompt "
                                  "to be false")
            if self.messages[-1].role != "assistant":
                raise field_error("continue_final_message", "continue_final_message needs the last message to "
                                  "be an assistant message")
        names = {t.name for t in self.function_defs()}
        choice = self.tool_choice_name()
        if not names:
            raw = self.tool_choice if self.functions is None else self.function_call
            choice = raw.function.name if isinstance(raw, NamedToolChoice) else (
                raw.name if isinstance(raw, FunctionName) else raw)
        if choice in ("required",) or (choice not in (None, "none", "auto")):
            field = "tool_choice" if self.functions is None else "function_call"
            if not names:
                raise field_error(field, f"{field} {choice!r} needs a non-empty list of tools")
            if choice != "required" and choice not in names:
                raise field_error(field, f"{field} names the function {choice!r}, which is not among the tools")
        return self

    def function_defs(self) -> list[FunctionDef]:
        if self.tools:
            return [t.function for t in self.tools]
        return list(self.functions or [])

    def tool_choice_name(self) -> str | None:
        """None (no tools), "none", "auto", "required", or the name of the one function to call."""
        if not self.function_defs():
            return None
        if self.functions is not None:
            fc = self.function_call
            return fc.name if isinstance(fc, FunctionName) else (fc or "auto")
        tc = self.tool_choice
        return tc.function.name if isinstance(tc, NamedToolChoice) else (tc or "auto")

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        bad += [name for name in ("audio", "prediction") if getattr(self, name)]
        if self.modalities not in (None, ["text"]):
            bad.append("modalities")
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list) and any(isinstance(p, ImagePart) for p in m.content):
                bad.append(f"messages[{i}].content")
        return bad

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses -------------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCallOut | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "leapdecode"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RootRequest):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise field_error("prompt", "send exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RootRequest):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(..., max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
