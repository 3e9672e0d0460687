"""Request and response models of the OpenAI-compatible API (pydantic v2).

Requests forbid unknown fields, as OpenAI does ("Unrecognized request argument supplied"), so a typo never turns
into a silently ignored setting. Fields that OpenAI defines but this server cannot honour yet are declared anyway
and rejected with a clear 400 when they are actually used (see ``unsupported_fields``); fields that only carry
bookkeeping for OpenAI's platform (``user``, ``store``, ``metadata``, ...) are accepted and ignored.

The vLLM-style extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ...) are accepted on both endpoints; the ``openai`` client sends them via ``extra_body``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's own limit on ``n``; it also keeps one request from monopolising the KV pool.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def field_error(param: str, message: str) -> PydanticCustomError:
    """A cross-field validation error that still names its field (the 400 body's ``param``)."""
    return PydanticCustomError("invalid_field", message, {"param": param})


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StrictModel(BaseModel):
    """Base of every request model: unknown fields are errors, NaN/Infinity are not numbers."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(StrictModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


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


# -- the sampling fields both endpoints share ------------------------------------------------------------------
class SamplingFields(StrictModel):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # Accepted and ignored: bookkeeping for OpenAI's platform, meaningless here.
    user: str | None = None
    # Declared so the error says "not supported" rather than "unrecognized"; see unsupported_fields().
    logit_bias: dict[str, float] | None = None

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
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        return self

    def unsupported_fields(self) -> list[str]:
        """Fields that were set to something this server cannot do; the handler turns them into a 400."""
        return ["logit_bias"] if self.logit_bias else []

    def sampling_kwargs(self) -> dict[str, Any]:
        """Fields that map one to one onto SamplingParams (only those the client set, so model defaults apply)."""
        names = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
                 "skip_special_tokens", "include_stop_str_in_output")
        kw = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.response_format is not None:
            kw["structured"] = self.response_format.to_structured()
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
    max_tokens: int | None = Field(16, ge=1)             # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        if isinstance(v, list) and len(v) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts per request")
        return v

    @model_validator(mode="after")
    def _check_counts(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise field_error("best_of", "best_of must be >= n")
        if self.n * len(self.prompts()) > MAX_N:
            raise field_error("n", f"n times the number of prompts must be at most {MAX_N}")
        return self

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        if self.suffix:
            bad.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            bad.append("best_of")
        if self.echo and self.logprobs is not None:
            bad.append("echo")          # echo with logprobs needs prompt logprobs in OpenAI's legacy shape
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


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _content_needed(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise field_error("content", f"a '{self.role}' message needs content")
        return self

    def to_template(self) -> dict[str, Any]:
        """The plain dict a Hugging Face chat template expects (content parts joined into one string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content if isinstance(p, TextPart))
        # Few templates know OpenAI's newer "developer" role; it means what "system" means to them.
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)            # deprecated by OpenAI in favour of the next one
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Accepted and ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Declared so the error says "not supported"; see unsupported_fields().
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    def unsupported_fields(self) -> list[str]:
        bad = super().unsupported_fields()
        bad += [name for name in ("tools", "functions", "function_call", "audio", "prediction")
                if getattr(self, name)]
        if self.tool_choice not in (None, "none", "auto"):
            bad.append("tool_choice")
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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


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


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
