"""Weight updates (services/worker/weights) on tiny random Llama models: after an update from disk
(HF directory, GGUF) or from tensors (in process, shared memory) the runner's logits equal a
freshly built runner's on the new weights, bit for bit, through prefill, op-by-op and one-call
decode steps; every refused update leaves the old weights serving and the version where it was.
The distributed path is tests/unit/test_weight_update_distributed.py."""
from __future__ import annotations

import json
import os
import shutil

import gguf
import pytest
import torch
from safetensors.torch import save_file

from services.common.weight_sync import remove_shared_tensors, write_shared_tensors
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.linear import Linear
from services.worker.model_runner import ModelRunner
from services.worker.weights import WeightUpdateError
from tests.unit.tiny_gguf import write_gguf
from tests.unit.tiny_models import logits_by_position

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PAGE = 4
# Two requests: a 60-token then 20-token prefill, then decode steps of 2 rows (one-call steps on GGUF blocks).
SEQS = {"a": list(range(3, 73)), "b": [(7 * i) % 256 for i in range(23)]}
CHUNKS = {"a": [60], "b": [20]}


def tiny_hf(seed: int, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def save_hf(tmp_path, name: str, seed: int, **overrides) -> tuple[str, object]:
    model = tiny_hf(seed, **overrides)
    path = str(tmp_path / name)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def save_gguf(tmp_path, name: str, seed: int) -> str:
    return write_gguf(tiny_hf(seed), str(tmp_path / f"{name}.gguf"), gguf.GGMLQuantizationType.Q8_0)


def config(dtype: str = "float32") -> WorkerConfig:
    return WorkerConfig(dtype=dtype, page_size=PAGE, kv_cache_bytes=4 << 20, max_requests=4)


def runner(path: str, dtype: str = "float32") -> ModelRunner:
    return ModelRunner(config(dtype), load_checkpoint(path))


def trace(r: ModelRunner) -> list[torch.Tensor]:
    """Every logits row of the fixed two-request run (prefill chunks, then decode steps)."""
    return [row for rid in SEQS for _, row in logits_by_position(r, SEQS, CHUNKS, PAGE)[rid]]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def snapshot(r: ModelRunner) -> dict:
    """Everything a step computes with: parameters, and which compute copies each linear holds."""
    linears = [m for m in r.model.modules() if isinstance(m, Linear)]
    return {"params": {n: p.detach().clone() for n, p in r.model.named_parameters()},
            "quant": [m.quant for m in linears], "packed": [m.packed for m in linears],
            "stack": r.model.decode_stack, "flags": (r.one_call_rows, r.decode_stack, r.verify_rows, r.prepacked)}


def assert_unchanged(r: ModelRunner, before: dict, logits: list[torch.Tensor]) -> None:
    after = snapshot(r)
    assert r.weights_version == 0
    assert after["params"].keys() == before["params"].keys()
    assert all(torch.equal(after["params"][n], p) for n, p in before["params"].items())
    assert all(a is b for a, b in zip(after["quant"], before["quant"]))
    assert all(a is b for a, b in zip(after["packed"], before["packed"]))
    assert after["stack"] is before["stack"] and after["flags"] == before["flags"]
    assert same(trace(r), logits)


def assert_serves_like(r: ModelRunner, fresh: ModelRunner, old: list[torch.Tensor]) -> None:
    new = trace(fresh)
    assert same(trace(r), new)
    assert not same(new, old)
    assert (r.quantized_weights, r.one_call_rows, r.decode_stack, r.verify_rows, r.prepacked) == (
        fresh.quantized_weights, fresh.one_call_rows, fresh.decode_stack, fresh.verify_rows, fresh.prepacked)


def hf_state(model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(dtype).clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


def quant_kernel_builds() -> bool:
    from kernels import quant_gemv
    return quant_gemv.load() is not None


# --- from disk ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_from_hf_directory_serves_like_a_fresh_runner(tmp_path, dtype):
    old, _ = save_hf(tmp_path, "old", 0)
    new, _ = save_hf(tmp_path, "new", 1)
    r = runner(old, dtype)
    before = trace(r)
    report = r.update_weights_from_disk(new)
    assert (report.path, report.version, r.weights_version, report.source) == ("disk", 1, 1, new)
    assert report.num_tensors == len(load_checkpoint(new).tensors) and report.bytes > 0
    assert min(report.load_seconds, report.validate_seconds, report.swap_seconds) >= 0
    assert_serves_like(r, runner(new, dtype), before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_from_gguf_uses_its_quantized_blocks_and_rebuilds_the_decode_stack(tmp_path, dtype):
    old, new = save_gguf(tmp_path, "old", 0), save_gguf(tmp_path, "new", 1)
    r = runner(old, dtype)
    stack = r.model.decode_stack
    before = trace(r)
    r.update_weights_from_disk(new)
    fresh = runner(new, dtype)
    if quant_kernel_builds():
        assert fresh.quantized_weights > 0 and fresh.decode_stack
        assert r.model.decode_stack is not stack  # rebuilt on the new blocks
    assert_serves_like(r, fresh, before)


def test_hf_tensors_on_a_gguf_runner_drop_the_blocks_and_the_stack(tmp_path):
    """A runner started from a GGUF, updated with HF tensors, runs dense like one started from HF."""
    r = runner(save_gguf(tmp_path, "old", 0))
    before = trace(r)
    new, hf = save_hf(tmp_path, "new", 1)
    r.update_weights_from_tensor(hf_state(hf))
    assert r.quantized_weights == 0 and not r.decode_stack and r.model.decode_stack is None
    assert all(m.quant is None for m in r.model.modules() if isinstance(m, Linear))
    assert_serves_like(r, runner(new), before)


def test_tied_lm_head_stays_tied(tmp_path):
    old, _ = save_hf(tmp_path, "old", 0)
    _, hf = save_hf(tmp_path, "new", 1)
    r = runner(old)
    r.update_weights_from_tensor(hf_state(hf))
    assert r.model.lm_head.weight is r.model.embed_tokens.weight
    assert torch.equal(r.model.embed_tokens.weight, hf.model.embed_tokens.weight)


def test_untied_lm_head_is_updated(tmp_path):
    old, _ = save_hf(tmp_path, "old", 0, tie_word_embeddings=False)
    new, hf = save_hf(tmp_path, "new", 1, tie_word_embeddings=False)
    r = runner(old)
    before = trace(r)
    r.update_weights_from_tensor({n: t.clone() for n, t in hf.state_dict().items()})
    assert_serves_like(r, runner(new), before)


# --- from tensors -------------------------------------------------------------------------------
def test_from_shared_memory_bfloat16_tensors(tmp_path):
    """The trainer's tensors in bfloat16 through /dev/shm: the worker casts them as a runner
    started from a bfloat16 checkpoint of them would."""
    old, _ = save_hf(tmp_path, "old", 0)
    _, hf = save_hf(tmp_path, "new", 1)
    state = hf_state(hf, torch.bfloat16)
    ref = tmp_path / "ref"  # the same bfloat16 tensors as a checkpoint on disk
    ref.mkdir()
    shutil.copy(os.path.join(old, "config.json"), ref / "config.json")
    save_file(state, str(ref / "model.safetensors"))
    r = runner(old)
    before = trace(r)
    path = write_shared_tensors(state)
    try:
        report = r.update_weights_from_tensor(shm_path=path)
    finally:
        remove_shared_tensors(path)
    assert (report.path, report.version, report.num_tensors) == ("tensor", 1, len(state))
    assert report.bytes == sum(t.numel() * 2 for t in state.values())
    assert_serves_like(r, runner(str(ref)), before)


def test_versions_count_successes_only(tmp_path):
    old, hf_old = save_hf(tmp_path, "old", 0)
    _, hf_new = save_hf(tmp_path, "new", 1)
    r = runner(old)
    assert r.weights_version == 0
    assert r.update_weights_from_tensor(hf_state(hf_new)).version == 1
    with pytest.raises(WeightUpdateError):
        r.update_weights_from_tensor({})
    assert r.weights_version == 1
    assert r.update_weights_from_tensor(hf_state(hf_old)).version == 2
    assert r.update_weights_from_disk(old).version == 3


# --- refusals: the old weights keep serving -----------------------------------------------------
def _broken_states(hf) -> dict[str, tuple[dict, str]]:
    state = hf_state(hf)
    missing = dict(state)
    del missing["model.layers.1.mlp.down_proj.weight"]
    misshapen = {**state, "model.norm.weight": torch.ones(65)}
    unknown = {**state, "model.layers.0.mlp.extra.weight": torch.ones(3)}
    integer = {**state, "model.norm.weight": torch.ones(64, dtype=torch.int32)}
    nan = {**state, "model.layers.0.input_layernorm.weight": torch.full((64,), float("nan"))}
    return {"missing": (missing, "lacks"), "shape": (misshapen, r"norm.weight: checkpoint shape \(65,\)"),
            "unknown": (unknown, "extra"), "dtype": (integer, "floating-point"), "nan": (nan, "non-finite")}


@pytest.mark.parametrize("case", ["missing", "shape", "unknown", "dtype", "nan"])
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_refused_tensors_leave_the_old_weights_serving(tmp_path, case, kind):
    _, hf = save_hf(tmp_path, "new", 1)
    r = runner(save_hf(tmp_path, "old", 0)[0] if kind == "hf" else save_gguf(tmp_path, "old", 0))
    logits, before = trace(r), snapshot(r)
    tensors, words = _broken_states(hf)[case]
    with pytest.raises(WeightUpdateError, match=words):
        r.update_weights_from_tensor(tensors)
    assert_unchanged(r, before, logits)


def _write(path, content: bytes) -> str:
    with open(path, "wb") as f:
        f.write(content)
    return str(path)


def test_refused_files_leave_the_old_weights_serving(tmp_path):
    old = save_gguf(tmp_path, "old", 0)
    r = runner(old)
    logits, before = trace(r), snapshot(r)
    other_rope, _ = save_hf(tmp_path, "rope", 1, rope_theta=500.0)  # same shapes, other math
    wider, _ = save_hf(tmp_path, "wider", 1, hidden_size=128)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(wider, "config.json"), no_weights / "config.json")
    truncated = tmp_path / "truncated"
    shutil.copytree(save_hf(tmp_path, "new", 1)[0], truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:5000])
    cases = {
        str(tmp_path / "nowhere"): "does not exist",
        _write(tmp_path / "junk.gguf", b"not a gguf file at all"): "cannot load",
        other_rope: "rope_theta",
        wider: "hidden_size",
        str(no_weights): "safetensors",
        str(truncated): "cannot load",
    }
    for path, words in cases.items():
        with pytest.raises(WeightUpdateError, match=words):
            r.update_weights_from_disk(path)
    assert_unchanged(r, before, logits)


def test_refused_shared_memory_files_leave_the_old_weights_serving(tmp_path):
    old, _ = save_hf(tmp_path, "old", 0)
    _, hf = save_hf(tmp_path, "new", 1)
    r = runner(old)
    logits, before = trace(r), snapshot(r)
    good = write_shared_tensors(hf_state(hf), directory=str(tmp_path))
    raw = open(good, "rb").read()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    header["model.norm.weight"]["data_offsets"][1] += 4  # a byte range the shape does not say
    body = json.dumps(header).encode()
    lying = _write(tmp_path / "lying", len(body).to_bytes(8, "little") + body + raw[8 + length:])
    cases = {
        str(tmp_path / "gone.safetensors"): "cannot read",
        _write(tmp_path / "tiny", b"abc"): "not a safetensors file",
        _write(tmp_path / "huge_header", (1 << 40).to_bytes(8, "little") + b"{}"): "does not fit",
        _write(tmp_path / "not_json", (4).to_bytes(8, "little") + b"{{{{"): "unreadable",
        _write(tmp_path / "truncated", raw[:len(raw) // 2]): "byte range",
        lying: "byte range",
    }
    for path, words in cases.items():
        with pytest.raises(WeightUpdateError, match=words):
            r.update_weights_from_tensor(shm_path=path)
    with pytest.raises(WeightUpdateError, match="either"):
        r.update_weights_from_tensor()
    assert_unchanged(r, before, logits)
