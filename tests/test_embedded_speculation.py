"""The embedded model through the engine: it runs offline with no flag, and on copy-heavy prompts the suffix
drafter's drafts are really accepted (mean > 2 tokens per step) while greedy output stays identical."""
import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.assets import default_model_path   # pinned: LLM() with no model is SmolLM2 when installed

FUNCTIONS = [
    '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''',
    '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from empty stack")
        return self._items.pop()
''',
]


def copy_prompt(source: str) -> str:
    """Code, then the start of the same code again: continuing it means copying."""
    return source + "\n\n# The same code again, unchanged:\n" + source.split("\n")[0] + "\n"


@pytest.fixture(scope="module")
def plain():
    return LLM(default_model_path(), max_model_len=1024)


def test_default_model_runs_with_no_flag(plain):
    out = plain.generate(["def fibonacci(n):"], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text.strip()


def test_copy_heavy_prompts_accept_more_than_two_tokens_per_step(plain):
    prompts = [copy_prompt(f) for f in FUNCTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=96)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(default_model_path(), max_model_len=1024, speculative_config={"method": "suffix", "num_speculative_tokens": 8,
                                                       "adaptive": False})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    steps = sum(o.metrics.num_steps for o in outs)
    emitted = sum(o.metrics.num_steps + o.metrics.num_accepted_tokens for o in outs)
    assert emitted / steps > 2.0, [o.metrics.mean_accepted_per_step for o in outs]   # measured 1.57 and 6.4
