"""The attention backends own their tuning (services/worker/attention/cpu_backend.py): the "cpu"
backend puts a quantized checkpoint's small pure-decode steps on the one-call decode stack, the
"torch" backend never does, an architecture the stack lacks is declined and runs op by op with
the same logits, and the model runner itself imports none of the CPU modules."""
from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path

import gguf
import pytest

from tests.kernel_builds import built
import torch

from kernels import decode_stack, fused_cpu, quant_gemv
from kernels.quant_gemv import QuantWeight
from services.worker.attention.backend import Attached, DecodeStep
from services.worker.attention.cpu_backend import CpuBackend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import Checkpoint, load_checkpoint
from services.worker.model_runner import ModelRunner
from tests.unit.test_decode_stack import _decode
from tests.unit.tiny_models import logits_by_position, save_tiny, sequences

REPO = Path(__file__).resolve().parents[2]
CPU_MODULES = ("services.worker.cpu_tuning", "services.worker.lead_cpu", "services.worker.fallbacks",
               "services.worker.attention.cpu_backend", "kernels")


@pytest.fixture
def needs_stack_kernels() -> None:
    """The decode stack, fused ops and quantized GEMV kernels, built (tests/kernel_builds.py)."""
    for kernel in (decode_stack, fused_cpu, quant_gemv):
        built(kernel)


needs_stack = pytest.mark.usefixtures("needs_stack_kernels")


def _quantized_tiny(tmp_path, name: str) -> Checkpoint:
    """A tiny transformers model (tests/unit/tiny_models.py) with Q8_0 blocks of its
    2-D weights, as a GGUF checkpoint carries them."""
    path, _ = save_tiny(tmp_path, name)
    ckpt = load_checkpoint(path)
    q8 = gguf.GGMLQuantizationType.Q8_0
    blocks = {n: QuantWeight.from_blocks(torch.from_numpy(gguf.quants.quantize(t.float().numpy(), q8)), "Q8_0")
              for n, t in ckpt.tensors.items() if t.dim() == 2 and t.shape[1] % 32 == 0}
    return dataclasses.replace(ckpt, quantized=blocks)


def _runner(ckpt: Checkpoint, backend: str, stack: bool = True) -> ModelRunner:
    return ModelRunner(WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4,
                                    attention_backend=backend, decode_stack=stack), ckpt)


def _count_one_calls(runner: ModelRunner, monkeypatch) -> list[int]:
    """Counts the model's one-call decode steps (the real ones run)."""
    calls, real = [0], runner.model.decode_step

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(runner.model, "decode_step", counting)
    return calls


def _run(runner: ModelRunner) -> dict:
    """Two requests: prefill chunks, then decode steps of both rows (within --quant-max-rows 2)."""
    seqs = sequences("two")
    return logits_by_position(runner, seqs, {"a": [60], "b": [20]}, 4)


def _equal(got: dict, want: dict) -> bool:
    return all(p == q and torch.equal(g, w) for rid in want for (p, g), (q, w) in zip(got[rid], want[rid]))


def test_the_torch_backend_never_takes_the_one_call_path(tmp_path, monkeypatch):
    ckpt = _quantized_tiny(tmp_path, "mistral_no_window")
    runner = _runner(ckpt, "torch")
    assert type(runner.backend) is TorchAttentionBackend
    assert runner.quantized_weights == 0 and runner.decode_stack is False and runner.model.decode_stack is None
    calls = _count_one_calls(runner, monkeypatch)
    _run(runner)
    assert calls[0] == 0
    step = DecodeStep([1], [0], [0], [0], runner.page_table, 4, runner.pool)
    assert runner.backend.one_call_step(step, lambda: pytest.fail("computed")) is None
    assert runner.backend.attach(runner.model, runner.config, ckpt, False) == Attached()


@needs_stack
def test_the_cpu_backend_runs_small_decode_steps_as_one_call(tmp_path, monkeypatch):
    """Same logits, bit for bit, as the cpu backend with --no-decode-stack (op by op)."""
    ckpt = _quantized_tiny(tmp_path, "mistral_no_window")
    stacked, plain = _runner(ckpt, "cpu"), _runner(ckpt, "cpu", stack=False)
    assert isinstance(stacked.backend, CpuBackend) and stacked.decode_stack and stacked.quantized_weights > 0
    assert stacked.model.decode_stack is not None and not plain.decode_stack
    calls = _count_one_calls(stacked, monkeypatch)
    got, want = _run(stacked), _run(plain)
    assert calls[0] == 10  # every decode step: a's 10 (positions 60..69), the first 3 with b's
    assert _equal(got, want)


@pytest.mark.parametrize("name,refusal", [("qwen3_mha_untied", "q/k RMSNorm"), ("mistral_window", "sliding-window"),
                                          ("qwen3_moe", "mixture-of-experts")])
def test_the_cpu_backend_declines_the_stack_for_what_it_lacks(tmp_path, caplog, name, refusal):
    """A quantized checkpoint of an architecture the stack does not compute: declined (logged),
    the quantized weights still used, and the same logits as op by op."""
    ckpt = _quantized_tiny(tmp_path, name)
    with caplog.at_level(logging.INFO, logger="services.worker.attention.cpu_backend"):
        runner = _runner(ckpt, "cpu")
    assert runner.quantized_weights > 0
    assert runner.decode_stack is False and runner.model.decode_stack is None
    built(fused_cpu), built(decode_stack)  # the stack was available to decline
    assert any("one-call decode steps declined" in r.message and refusal in r.message for r in caplog.records)
    assert _equal(_run(runner), _run(_runner(ckpt, "cpu", stack=False)))


def test_the_model_runner_imports_no_cpu_module():
    tree = ast.parse((REPO / "services/worker/model_runner.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert imported, "no imports found: the parse is wrong"
    assert [m for m in imported if m.startswith(CPU_MODULES)] == []


@needs_stack
def test_the_default_model_decodes_as_one_call_on_the_cpu_backend_only(checkpoint, monkeypatch):
    counts = {}
    for backend in ("torch", "cpu"):
        runner = ModelRunner(WorkerConfig(kv_cache_bytes=8 << 20, max_requests=4, attention_backend=backend),
                             checkpoint)
        calls = _count_one_calls(runner, monkeypatch)
        _decode(runner, ["a", "b"], 3)
        counts[backend] = calls[0]
    assert counts == {"torch": 0, "cpu": 3}
