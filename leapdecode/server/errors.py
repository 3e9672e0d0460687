"""OpenAI-shaped errors: ``APIError``, the mapping of FastAPI's validation errors and of engine ValueErrors to a
400 naming the request field, the exception handlers, and the two ASGI middlewares (body size limit, HTTP
request metrics).

Every error body is ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import logging
import re
import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from leapdecode.server.metrics import ServerMetrics
from leapdecode.server.preprocess import PreprocessBusy

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Raised anywhere in a handler; rendered as OpenAI's error body with this status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _error_type(status)
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type or _error_type(status), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- request validation (FastAPI/pydantic) -----------------------------------------------------------------------
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _param_from_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; union-member tags are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(item, int):
            if not parts:
                break
            parts[-1] += f"[{item}]"
        elif isinstance(item, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", item) and item not in _TYPE_TAGS \
                and not item[0].isupper():
            parts.append(item)
        else:
            break
    return ".".join(parts) or None


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body")
    err = errors[0]
    kind, msg, loc = err.get("type", ""), str(err.get("msg", "invalid value")), tuple(err.get("loc", ()))
    param = _param_from_loc(loc)
    ctx = err.get("ctx") or {}
    if kind == "invalid_field":              # a cross-field check (protocol.field_error) naming its field
        inner = ctx.get("param")
        param = f"{param}.{inner}" if param and inner and not inner.startswith(param) else (inner or param)
        return error_response(400, msg, param=param, code="invalid_value")
    if kind == "json_invalid":
        detail = ctx.get("error", msg)
        return error_response(400, f"We could not parse the JSON body of your request: {detail}", code="json_invalid")
    if kind == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {param}", param=param,
                              code="unrecognized_argument")
    if kind == "missing" and param is None:
        return error_response(400, "The request body is missing", code="missing_body")
    if kind == "missing":
        return error_response(400, f"Missing required parameter: '{param}'", param=param, code="missing_parameter")
    msg = msg.removeprefix("Value error, ")
    if param is None and kind == "model_attributes_type":
        return error_response(400, "The request body must be a JSON object", code="invalid_body")
    where = f"Invalid value for '{param}': " if param else ""
    return error_response(400, f"{where}{msg}", param=param, code="invalid_value")


# -- engine errors -------------------------------------------------------------------------------------------------
# Engine/SamplingParams field -> request field, per endpoint.
COMPLETION_FIELDS = {"structured": "response_format", "n": "best_of"}
CHAT_FIELDS = {"structured": "response_format", "logprobs": "top_logprobs"}


def invalid_value(exc: ValueError, fields: dict[str, str], prompt_field: str) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine, naming the request field it is about."""
    return APIError(400, str(exc), param=_engine_error_param(exc, fields, prompt_field), code="invalid_value")


def _engine_error_param(exc: ValueError, fields: dict[str, str], prompt_field: str) -> str | None:
    # leapdecode.errors.InvalidParameter names its field; plain ValueErrors (the engine's own checks, until they
    # raise InvalidParameter too) fall back to reading the message.
    param = getattr(exc, "param", None)
    if param is not None:
        return prompt_field if param == "prompt" else fields.get(param, param)
    message = str(exc)
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return fields.get(m.group(1), m.group(1))
    low = message.lower()
    if low.startswith("prompt") or "max_model_len" in low or "chat template" in low:
        return prompt_field
    if any(word in low for word in ("structured", "schema", "response_format", "grammar", "json")):
        return "response_format"
    return None


def install_error_handlers(app: FastAPI, metrics: ServerMetrics | None = None) -> None:
    def failed(cause: str | None, request: Request | None = None, message: str = "") -> None:
        if metrics is not None:
            metrics.failures.labels(cause=cause or "other").inc()
        if request is not None:
            logger.info("request failed: request_id=%s path=%s cause=%s %s", request.scope.get("request_id"),
                        request.url.path, cause, message[:200])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        failed(exc.code or str(exc.status), request, exc.message)
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, type=exc.type,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        response = _validation_error(exc)
        failed("invalid_request", request)
        return response

    @app.exception_handler(PreprocessBusy)
    async def _busy(request: Request, exc: PreprocessBusy) -> JSONResponse:
        failed("queue_full", request, str(exc))
        return error_response(503, f"The server is overloaded: {exc}. Retry later.", code="queue_full",
                              headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        failed("client_gone", request)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s (request id %s)", request.method, request.url.path,
                         request.scope.get("request_id"))
        failed("internal", request)
        return error_response(500, f"internal server error: {type(exc).__name__}")


# -- middleware ------------------------------------------------------------------------------------------------
class RequestSizeLimit:
    """Refuse bodies over ``limit`` bytes before anything reads them (413), so a client cannot make us buffer
    an arbitrarily large body; chunked bodies are counted as they arrive."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                response = error_response(413, f"request body is larger than {self.limit} bytes",
                                          code="request_too_large")
                return await response(scope, receive, send)
        seen = 0

        async def counted_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, f"request body is larger than {self.limit} bytes", code="request_too_large")
            return message

        await self.app(scope, counted_receive, send)


class RequestId:
    """Echo the client's ``X-Request-Id`` (or a fresh one) on every response, and keep it in the ASGI scope for
    the logs."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = b""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                rid = value[:256]
                break
        if not rid or any(b < 0x21 or b > 0x7e for b in rid):
            rid = uuid.uuid4().hex.encode()
        scope["request_id"] = rid.decode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class HTTPMetrics:
    """Count every HTTP response by route template (bounded label values) and status code."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        recorded = False

        def record(status: int) -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                route = scope.get("route")
                endpoint = getattr(route, "path", None) or "unmatched"
                self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                record(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            record(500)
            raise
