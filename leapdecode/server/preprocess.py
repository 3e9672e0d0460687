"""Request preparation off the engine thread: tokenization, chat templates and grammar compilation run in a small
worker pool, each request under a deadline, so a huge prompt or a slow schema waits alone and never stalls the
engine's steps (which only ever receive token ids and already compiled grammars).

Tokenizers: an HF ``tokenizers`` object must not be used by two threads at once (its Rust core sits in a RefCell,
huggingface/tokenizers#537), so each worker thread has its own deep copy, made from a pristine copy taken at
startup before the engine thread runs. The engine thread keeps its own instance for detokenization.

Cheap bounds first: a text whose UTF-8 size exceeds ``max_model_len`` times the longest token's byte length
cannot fit in the context, and is refused before anything tokenizes it.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from leapdecode.errors import InvalidParameter

DEFAULT_WORKERS = 2
DEFAULT_TIMEOUT_S = 30.0


class PreprocessTimeout(Exception):
    """A request's preparation did not finish before its deadline."""


class PreprocessBusy(Exception):
    """Too many requests are already being prepared; the client should retry later."""


class Preprocessor:
    def __init__(self, engine: Any, *, workers: int = DEFAULT_WORKERS, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_pending: int = 512) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._pristine = copy.deepcopy(engine.tokenizer)
        self.chat_template = getattr(self._pristine, "chat_template", None)
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="leapdecode-prep")
        self.max_token_bytes = _max_token_bytes(self._pristine)
        self.in_progress = 0

    # -- running work ------------------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the pool; PreprocessTimeout past the deadline (the worker finishes in the
        background; its result is dropped); PreprocessBusy when ``max_pending`` preparations are under way (the
        pool's queue is bounded like the engine's)."""
        if self.in_progress >= self.max_pending:
            raise PreprocessBusy(f"{self.in_progress} requests are already being prepared")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, fn, *args)
        self.in_progress += 1
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise PreprocessTimeout(f"preparing the request took longer than {self.timeout_s:g} s") from None
        finally:
            self.in_progress -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self) -> Any:
        """This worker thread's own tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:
                tok = self._local.tokenizer = copy.deepcopy(self._pristine)
        return tok

    # -- checks before the work --------------------------------------------------------------------------------
    def check_text_size(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit in the context whatever its tokenization, without tokenizing it."""
        limit = self.max_token_bytes * self.max_model_len
        if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
            raise InvalidParameter(f"{param} is far longer than the context ({self.max_model_len} tokens)",
                                   param="prompt")

    # -- the work (worker threads) -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if not text:
            raise InvalidParameter("prompt must not be empty", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    continue_final_message: bool, tools: list[dict[str, Any]] | None,
                    template_kwargs: dict[str, Any] | None, add_special_tokens: bool) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidParameter("this model has no chat template; use /v1/completions", param="prompt")
        kwargs = dict(template_kwargs or {})
        for reserved in ("messages", "conversation", "tokenize", "tools", "add_generation_prompt",
                         "continue_final_message", "chat_template", "return_dict", "return_tensors"):
            if reserved in kwargs:
                raise InvalidParameter(f"chat_template_kwargs must not set {reserved!r}", param="chat_template_kwargs")
        try:
            text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, **kwargs)
        except (ValueError, TypeError) as exc:
            raise InvalidParameter(f"chat template failed on these messages: {exc}", param="prompt") from None
        except Exception as exc:          # jinja2 TemplateError and friends: the conversation was refused
            raise InvalidParameter(f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                                   param="prompt") from None
        if not isinstance(text, str) or not text:
            raise InvalidParameter("the chat template rendered an empty prompt", param="prompt")
        self.check_text_size(text, "the rendered conversation")
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def compile(self, structured: dict[str, Any]) -> None:
        """Compile (and cache) a grammar so that the engine thread's compile at submission is a cache hit."""
        structured_output = self.engine.structured
        with self._backend_lock:
            backend = structured_output.backend          # built once, here, never on the engine thread
        backend.compile(structured)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]


def _max_token_bytes(tokenizer: Any) -> int:
    """An upper bound of the bytes one token stands for (its vocabulary piece's UTF-8 length bounds it for
    byte-level BPE and SentencePiece alike), plus slack for normalizers."""
    try:
        longest = max((len(piece.encode("utf-8", "surrogatepass")) for piece in tokenizer.get_vocab()), default=16)
    except Exception:                      # a tokenizer without a vocabulary listing: a generous bound
        longest = 64
    return max(longest, 4) * 2 + 8
