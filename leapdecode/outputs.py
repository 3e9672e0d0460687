"""What generate()/stream() hand back: vLLM's shape (RequestOutput with one CompletionOutput per sample)."""
from __future__ import annotations

from dataclasses import dataclass, field

# One position's logprobs: token id -> logprob (the chosen token always included).
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it; for "error", the message
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_steps: int = 0             # decode/verify steps that produced tokens
    num_draft_tokens: int = 0      # speculation: tokens proposed
    num_accepted_tokens: int = 0   # speculation: proposed tokens accepted

    @property
    def mean_accepted_per_step(self) -> float:
        """Tokens emitted per model step (1.0 without speculation)."""
        return (self.num_steps + self.num_accepted_tokens) / max(self.num_steps, 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
