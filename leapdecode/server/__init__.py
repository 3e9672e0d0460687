"""OpenAI-compatible HTTP serving: ``build_app(llm)`` gives a FastAPI app; ``leapdecode serve`` runs it."""
from leapdecode.server.app import build_app
from leapdecode.server.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError, RequestHandle
from leapdecode.server.metrics import ServerMetrics

__all__ = ["build_app", "AsyncEngine", "RequestHandle", "QueueFullError", "EngineUnavailableError", "ServerMetrics"]
