"""Drafters by name, so configs and the CLI can say ``method="suffix"`` and pass options through."""
from __future__ import annotations

from typing import Any, Callable

from leapdecode.spec.auto import AutoDrafter
from leapdecode.spec.drafter import Drafter
from leapdecode.spec.ngram import NgramDrafter
from leapdecode.spec.recycling import RecyclingDrafter
from leapdecode.spec.suffix import SuffixDrafter

_FACTORIES: dict[str, Callable[..., Drafter]] = {
    "ngram": NgramDrafter,
    "suffix": SuffixDrafter,
    "recycling": RecyclingDrafter,
}
DEFAULT_AUTO_METHODS = ("suffix", "recycling")
# drafters that run a model inside the step: built with a handle to the target's runner (``runner=``), see
# spec/draft_model.py (the seam) and docs/architecture.md
MODEL_METHODS = ("draft_model", "layer_skip", "kangaroo", "eagle")
METHODS = (*_FACTORIES, "auto", *MODEL_METHODS)


def _model_factory(method: str) -> Callable[..., Drafter]:
    if method == "eagle":
        from leapdecode.spec.eagle import EagleDrafter
        return EagleDrafter.for_runner
    if method == "draft_model":
        from leapdecode.spec.draft_model import DraftModelDrafter
        return DraftModelDrafter
    if method == "kangaroo":
        from leapdecode.spec.kangaroo import KangarooDrafter
        return KangarooDrafter
    from leapdecode.spec.layer_skip import LayerSkipDrafter
    return LayerSkipDrafter


def make_drafter(method: str, runner: Any = None, **options: Any) -> Drafter:
    """A drafter for ``method`` with its constructor ``options`` (a bad name or option is a ValueError).

    ``"auto"`` builds an :class:`AutoDrafter` over ``methods`` (default: suffix and recycling; at most one of them
    may run a model, e.g. ``("suffix", "layer_skip")``, and is then asked only where the model-free drafts promise
    less); per-method options go in a dict under the method's name, e.g. ``make_drafter("auto", recycling={
    "vocab_size": 128256})``, and a top-level ``vocab_size`` is handed to the recycling drafter (and
    ``num_speculative_tokens`` to the model drafter). Other keys configure the AutoDrafter itself.
    """
    if method == "auto":
        methods = tuple(options.pop("methods", DEFAULT_AUTO_METHODS))
        vocab_size = options.pop("vocab_size", None)
        k = options.pop("num_speculative_tokens", None)
        sub_options = {name: dict(options.pop(name, {}) or {}) for name in (*_FACTORIES, *MODEL_METHODS)}
        if vocab_size is not None:
            sub_options["recycling"].setdefault("vocab_size", vocab_size)
        if k is not None:
            for name in MODEL_METHODS:
                sub_options[name].setdefault("num_speculative_tokens", k)
        unknown = [m for m in methods if m not in _FACTORIES and m not in MODEL_METHODS]
        models = [m for m in methods if m in MODEL_METHODS]
        if unknown or not methods or len(models) > 1 or len(set(methods)) < len(methods):
            raise ValueError(f"auto drafter methods must be distinct names from {tuple(_FACTORIES)} plus at most one "
                             f"of {MODEL_METHODS}, got {methods}")
        drafters = {name: make_drafter(name, runner=runner, **sub_options[name]) for name in methods}
        try:
            return AutoDrafter(drafters, costly=tuple(models), **options)
        except TypeError as e:
            raise ValueError(f"bad option for the auto drafter: {e}") from None
    if method in MODEL_METHODS:
        if runner is None:
            raise ValueError(f"the {method} drafter runs a model: it needs the target's runner (runner=...)")
        options.pop("vocab_size", None)
        try:
            return _model_factory(method)(runner, **options)
        except TypeError as e:
            raise ValueError(f"bad option for the {method} drafter: {e}") from None
    factory = _FACTORIES.get(method)
    if factory is None:
        raise ValueError(f"unknown drafter method {method!r}; choose one of {METHODS}")
    if method != "recycling":
        options.pop("vocab_size", None)     # only the recycling drafter is sized by the vocabulary
    try:
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"bad option for the {method} drafter: {e}") from None
