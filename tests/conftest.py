"""Shared fixtures: the default model loaded once, and the transformers reference."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def model_path() -> str:
    from services.common.model_path import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def checkpoint(model_path):
    from services.worker.loader.checkpoint import load_checkpoint
    return load_checkpoint(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from services.tokenizer.text_tokenizer import load_tokenizer
    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32)
    return model.eval()
