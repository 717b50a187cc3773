"""--quantization fp8 (services/worker/model/fp8_weights.py): the per-row e4m3 quantizer's error
bound, the CPU torch path against the float32 reference of the Triton kernel, a quantized-only
Linear, tiny-model runners (close to float32, no dense copy, weight updates requantize), and the
default model (slow: the `checkpoint` fixture): loads, holds about half of bfloat16's linear
bytes, and its greedy tokens agree with bfloat16's for a first stretch."""
from __future__ import annotations

import statistics

import pytest
import torch

from kernels.triton.fp8_gemm import E4M3, fp8_linear_reference
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model import weight_format
from services.worker.model.fp8_weights import Fp8Weight, torch_linear, widen
from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding
from services.worker.model.weight_bytes import resident_weight_bytes, weight_formats
from services.worker.model_runner import ModelRunner
from tests.unit.test_weight_update import PAGE, hf_state, same, save_hf, trace


def every_code() -> torch.Tensor:
    """The 254 finite e4m3fn values as float8 [2, 127]."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes[(codes & 0x7F) != 0x7F].view(E4M3).reshape(2, 127)


def test_quantize_round_trip_error_bound():
    """Each weight within half an e4m3 step of itself: |w|/16 for normal values (3 mantissa bits),
    scale/1024 in the subnormal range; each row's largest |w| lands on 448 * scale."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 200, generator=g) * torch.logspace(-4, 1, 64)[:, None]
    w[3] = 0.0  # a zero row: scale 1, zeros back
    w[5, 7] = 1e3  # an outlier sets its row's scale
    q = Fp8Weight.quantize(w)
    assert q.w.dtype == E4M3 and q.scale.dtype == torch.float32 and q.shape == (64, 200)
    assert q.nbytes == 64 * 200 + 64 * 4
    back = q.dequantize()
    assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros(200)) and q.scale[3] == 1
    bound = w.abs() / 16 + q.scale[:, None] / 1024
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    rows = [r for r in range(64) if r != 3]
    torch.testing.assert_close(q.scale[rows], w.abs().amax(1)[rows] / 448)
    assert torch.equal(q.w.float().abs().amax(1)[rows], torch.full((63,), 448.0))
    rel = ((back - w).norm() / w.norm()).item()
    assert 0.005 < rel < 0.04  # relative RMS error of round-to-nearest with 3 mantissa bits (~0.02)


def test_widen_is_exact_for_every_byte():
    codes = every_code()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = widen(codes, dtype)
        assert got.dtype == dtype and torch.equal(got, codes.to(dtype)), dtype
        assert torch.equal(torch.signbit(got), torch.signbit(codes.float()))  # -0.0 too
    with pytest.raises(ValueError, match="no widening"):
        widen(codes, torch.float64)


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 64, 130])
def test_cpu_path_matches_the_float32_reference(dtype, m):
    g = torch.Generator().manual_seed(m)
    q = Fp8Weight.quantize(torch.randn(97, 45, generator=g) * 0.05)
    x, bias = torch.randn(m, 45, generator=g).to(dtype), torch.randn(97, generator=g).to(dtype)
    want = fp8_linear_reference(x, q.w, q.scale, bias, float_out=True)
    got = q.linear(x, bias, float_out=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[dtype])
    out = torch_linear(x, q.w, q.scale, bias)
    assert out.dtype == dtype and torch.equal(out, q.linear(x, bias))
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    wrong = fp8_linear_reference(x, q.w, q.scale.roll(1), bias, float_out=True)
    assert not torch.allclose(wrong, want, **TOL[dtype])  # the tolerance can fail


def test_quantized_only_linear_holds_no_dense_weight():
    g = torch.Generator().manual_seed(1)
    lin = Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.bias.normal_(generator=g)
    q = Fp8Weight.quantize(lin.weight)
    lin.set_quant_only(q, None)  # FP8 needs no CPU kernel module
    assert lin.quant_only and lin.weight.is_meta and lin.weight.shape == (48, 64) and lin.prepack()
    x = torch.randn(2, 5, 64, generator=g)
    want = fp8_linear_reference(x.reshape(10, 64), q.w, q.scale, lin.bias.detach(), float_out=True)
    torch.testing.assert_close(lin(x).reshape(10, 48), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lin.logits(x.reshape(10, 64)), want, atol=2e-5, rtol=2e-5)
    assert resident_weight_bytes(lin) == q.nbytes + 48 * 4  # the bytes, the scales and the float32 bias
    with pytest.raises(ValueError, match="does not match"):
        lin.set_quant_only(Fp8Weight.quantize(torch.randn(48, 32)), None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4))
    with pytest.raises(ValueError, match="scale must be"):
        Fp8Weight(torch.zeros(4, 4).to(E4M3), torch.ones(3))


def test_fp8_runs_on_cpu_and_cuda_int8_and_gguf_on_cpu_only():
    for device in ("cpu", "cuda"):
        weight_format.check_quantization("fp8", device)
    with pytest.raises(ValueError, match="use --quantization fp8, auto or none"):
        weight_format.check_quantization("int8", "cuda")
    with pytest.raises(ValueError, match="must be one of"):
        weight_format.check_quantization("fp4", "cpu")


# --- tiny models ------------------------------------------------------------------------------
def runner(path: str, quantization: str, dtype: str = "float32") -> ModelRunner:
    config = WorkerConfig(dtype=dtype, page_size=PAGE, kv_cache_bytes=4 << 20, max_requests=4,
                          quantization=quantization)
    return ModelRunner(config, load_checkpoint(path, quantization))


def max_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_runner_is_close_to_dense_with_no_dense_copy(tmp_path, dtype):
    path = save_hf(tmp_path, "m", 0)[0]
    r, dense = runner(path, "fp8", dtype), runner(path, "none", dtype)
    layers = [m for m in r.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(m.quant_only and isinstance(m.quant, Fp8Weight) and m.packed is None for m in layers)
    assert all(m.quant.w.device.type == "cpu" for m in layers)
    # the embedding and the (tied) head stay dense, as int8 leaves them
    assert not isinstance(r.model.embed_tokens, QuantEmbedding) and not r.model.lm_head.quant_only
    assert f"{len(layers)} linears fp8_e4m3 only" in weight_formats(r.model)
    got, want = trace(r), trace(dense)
    assert max_rel_diff(got, want) < 0.05
    assert max_rel_diff(got, want) > 1e-4  # it did compute on the rounded weights
    size = 4 if dtype == "float32" else 2
    layer_numel = sum(m.weight.numel() for m in layers)
    dense_layers = sum(m.weight.numel() * size for m in dense.model.layers.modules() if isinstance(m, Linear))
    scales = sum(m.quant.scale.numel() * 4 for m in layers)
    packed = dense_layers if dense.prepacked else 0  # a prepacked bf16 linear holds a second copy
    assert r.weight_bytes == dense.weight_bytes - dense_layers - packed + layer_numel + scales


def test_fp8_weight_update_requantizes_like_a_fresh_runner(tmp_path):
    old, new = save_hf(tmp_path, "old", 0)[0], save_hf(tmp_path, "new", 1)
    r = runner(old, "fp8", "bfloat16")
    before = trace(r)
    r.update_weights_from_tensor(hf_state(new[1]))
    fresh = runner(new[0], "fp8", "bfloat16")
    after = trace(r)
    assert same(after, trace(fresh)) and not same(after, before)
    assert all(isinstance(m.quant, Fp8Weight) for m in r.model.layers.modules() if isinstance(m, Linear))
    assert r.weight_bytes == fresh.weight_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_on_cuda_runs_the_triton_kernel():
    g = torch.Generator().manual_seed(2)
    lin = Linear(576, 1536, bias=False)
    q = Fp8Weight.quantize(lin.weight.cuda())
    lin.set_quant_only(q, None)
    x = torch.randn(9, 576, generator=g).to(torch.bfloat16)
    want = fp8_linear_reference(x, q.w.cpu(), q.scale.cpu(), float_out=True)
    torch.testing.assert_close(lin.logits(x.cuda()).cpu(), want, atol=1e-4, rtol=1e-4)


# --- the default model (slow) -----------------------------------------------------------------
PROMPTS = ["The capital of France is", "def fibonacci(n):", "In the beginning God created",
           "Water boils at a temperature of"]
NEW_TOKENS = 16


def test_default_model_fp8_loads_halves_linear_bytes_and_agrees_with_bf16(checkpoint, tokenizer):
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine
    from services.scheduler.config import SchedulerConfig

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    runs = {}
    for mode in ("none", "fp8"):
        worker = WorkerConfig(dtype="bfloat16", kv_cache_bytes=32 << 20, max_requests=8, quantization=mode,
                              prepack_weights=False)
        engine = Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=8), checkpoint=checkpoint,
                        tokenizer=tokenizer)
        try:
            outs = engine.generate_batch(prompts, greedy)
            assert all(o.error is None for o in outs)
            model = engine.runner.model
            layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
            runs[mode] = ([o.token_ids for o in outs], engine.runner.weight_bytes, layers)
        finally:
            engine.shutdown()
    (dense_tokens, dense_bytes, dense_layers), (fp8_tokens, fp8_bytes, fp8_layers) = runs["none"], runs["fp8"]
    assert len(fp8_layers) == 30 * 4 and all(isinstance(m.quant, Fp8Weight) for m in fp8_layers)
    bf16_linear_bytes = sum(m.weight.numel() * 2 for m in dense_layers)
    fp8_linear_bytes = sum(m.quant.nbytes for m in fp8_layers)
    assert 0.5 <= fp8_linear_bytes / bf16_linear_bytes < 0.505  # one byte a weight plus the row scales
    # the rest (embedding/head, norms) is what bf16 holds, plus the file's Q8_0 head blocks for small
    # steps that --quantization fp8 keeps, as int8 does (weight_format.QUANT_ONLY in the cpu backend)
    assert fp8_bytes - fp8_linear_bytes < dense_bytes - bf16_linear_bytes + (32 << 20)
    first_divergence = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS)
                        for x, y in zip(fp8_tokens, dense_tokens)]
    print(f"fp8 vs bf16 first divergence per prompt: {first_divergence}; resident {fp8_bytes / 2**20:.1f} MiB "
          f"vs {dense_bytes / 2**20:.1f} MiB; linears {fp8_linear_bytes / 2**20:.1f} vs "
          f"{bf16_linear_bytes / 2**20:.1f} MiB")
    assert statistics.median(first_divergence) >= 4, first_divergence
