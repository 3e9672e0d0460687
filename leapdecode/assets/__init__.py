"""Model files shipped inside the leapdecode package.

``default_model/`` is a tiny Llama-architecture model trained on the Python standard library (a demo and test
model, not a useful code model or chat assistant); ``draft_model/`` is a much smaller model with the same tokenizer,
for draft-model speculative decoding. Both are standard Hugging Face directories (config.json, model.safetensors,
tokenizer.json, ...); see the README.md in each, and scripts/train_tiny_model.py to rebuild them.
"""

from __future__ import annotations

from pathlib import Path

_ASSETS = Path(__file__).resolve().parent

DEFAULT_MODEL_DIR = _ASSETS / "default_model"
DRAFT_MODEL_DIR = _ASSETS / "draft_model"


def _checked(path: Path) -> str:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"leapdecode's embedded model is missing at {path} (expected config.json there); "
            "reinstall leapdecode or rebuild it with scripts/train_tiny_model.py"
        )
    return str(path)


def default_model_path() -> str:
    """Directory of the embedded default (target) model, used when no model is given."""
    return _checked(DEFAULT_MODEL_DIR)


def default_draft_model_path() -> str:
    """Directory of the embedded draft model, which shares the default model's tokenizer."""
    return _checked(DRAFT_MODEL_DIR)


__all__ = ["default_model_path", "default_draft_model_path", "DEFAULT_MODEL_DIR", "DRAFT_MODEL_DIR"]
