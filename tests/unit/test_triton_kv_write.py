"""The Triton KV-cache write (kernels/triton/kv_write.py) against its torch reference, on CPU under
Triton's interpreter (enabled per module with the knob, as tests/unit/test_triton_bitmask.py
explains). The reference stores kernels/kv_fp8.quantize_kv's rows, so FP8 pools are checked to
the byte: the in-kernel Hadamard butterflies and the integer float8 encoding must round exactly
as torch does, edge cases (saturation, inf, NaN, subnormals, ties) included."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_fp8 import FP8_KV_SCALES, hadamard_rotate, quantize_kv
from kernels.triton import kv_write
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def garbage_pool(num_slots: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[S, Hkv, D] of random bytes, so a slot the write misses or a row it puts elsewhere shows."""
    raw = torch.randint(0, 256, (num_slots, hkv, d * torch.empty((), dtype=dtype).element_size()),
                        generator=g, dtype=torch.uint8)
    return raw.view(dtype)  # compared as bytes, so NaN patterns are fine


def write_both(pool_dtype, k, v, slots, num_slots: int, seed: int):
    """(kernel's k and v pools, reference's, the pools before) from one random start."""
    g = torch.Generator().manual_seed(seed)
    _, hkv, d = k.shape
    k0, v0 = garbage_pool(num_slots, hkv, d, pool_dtype, g), garbage_pool(num_slots, hkv, d, pool_dtype, g)
    ours, ref = (k0.clone(), v0.clone()), (k0.clone(), v0.clone())
    kv_write.write_kv_(*ours, k, v, slots)
    kv_write.write_kv_reference(*ref, k, v, slots)
    return ours, ref, (k0, v0)


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
    bad = (a8 != b8).nonzero()
    assert bad.numel() == 0, (f"{len(bad)} bytes differ, first at {bad[0].tolist()}: "
                              f"{a8[tuple(bad[0])]} vs {b8[tuple(bad[0])]}")


def spread_rows(T: int, hkv: int, d: int, dtype, g) -> torch.Tensor:
    """[T, Hkv, D] with ordinary rows, rows past e4m3's range (saturate), tiny ones (subnormal)
    and a constant head row of 6e4 (its rotation 6e4 sqrt(n) is past e5m2's range). No inf:
    rotated, inf - inf is a NaN whose sign bit the hardware picks
    (test_every_float32_class_encodes_as_torch covers inf and NaN)."""
    x = torch.randn(T, hkv, d, generator=g) * 3
    x[1::4] *= 400  # after H and / 0.25: well past 448
    x[2::4] *= 1e-4  # rotated and scaled into the subnormals
    x[0, 0] = 6e4  # float16's range holds it
    return x.to(dtype)


@pytest.mark.parametrize("pool_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src_dtype", FLOATS, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("hkv, d", [(1, 64), (2, 128), (3, 96), (8, 80)], ids=["d64", "d128", "d96", "d80"])
def test_fp8_pool_bytes_equal_quantize_kv(pool_dtype, src_dtype, hkv, d):
    """Head dims whose Hadamard blocks are 64, 128, 32 and 16 (96 and 80 pad the kernel's block)."""
    g = torch.Generator().manual_seed(d + hkv)
    T, S = 11, 40
    k, v = spread_rows(T, hkv, d, src_dtype, g), spread_rows(T, hkv, d, src_dtype, g).flip(0)
    slots = torch.randperm(S, generator=g)[:T]
    ours, ref, before = write_both(pool_dtype, k, v, slots, S, seed=d)
    for a, b in zip(ours, ref):
        assert_same_bytes(a, b)
    rest = torch.ones(S, dtype=torch.bool)
    rest[slots] = False
    assert torch.equal(ours[0].view(torch.uint8)[rest], before[0].view(torch.uint8)[rest])
    # the bytes are the rotated rows', not the plain ones' (the rotation is not skipped)
    plain = (k.float() / FP8_KV_SCALES[pool_dtype]).to(pool_dtype).view(torch.uint8)
    assert not torch.equal(ours[0][slots].view(torch.uint8), plain)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, on the interpreter's inf and NaN
@pytest.mark.parametrize("pool_dtype", FP8, ids=["e4m3", "e5m2"])
def test_every_float32_class_encodes_as_torch(pool_dtype):
    """D = 1 (no rotation: H = [1]): every bfloat16 bit pattern widened, 2^14 random float32 bit
    patterns, and the edges (saturation, the largest finite, ties, inf, NaN of both signs, zeros,
    the subnormal boundary) → the same bytes as torch's conversion of x / scale."""
    g = torch.Generator().manual_seed(7)
    bf16_all = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    random_bits = torch.randint(-2**31, 2**31 - 1, (2**14,), generator=g, dtype=torch.int64).to(torch.int32)
    scale = FP8_KV_SCALES[pool_dtype]
    edges = torch.tensor([447.0, 448.0, 449.0, 463.99, 464.0, 464.01, 479.0, 480.0, 57343.0, 57344.0, 61439.0,
                          61440.0, 61441.0, 65536.0, 3.4e38, 2**-6, 2**-7 * 1.5, 2**-9, 2**-10, 2**-10 * 1.0001,
                          2**-9 * 2.5, 2**-14, 2**-16 * 1.5, 2**-17, 2**-17 * 1.001, 1e-40, 0.0,
                          float("inf"), float("nan")]) * scale
    values = torch.cat([bf16_all, random_bits.view(torch.float32), edges, -edges])  # [N]
    values[-1] = -float("nan")  # torch's -nan for edges' nan: explicit
    k = values.view(-1, 1, 1)
    ours, ref, _ = write_both(pool_dtype, k, k, torch.arange(len(values)), len(values), seed=1)
    assert_same_bytes(ours[0], ref[0])
    assert_same_bytes(ours[1], ref[1])


@pytest.mark.parametrize("pool_dtype", FLOATS, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("src_dtype", FLOATS, ids=["f32", "bf16", "f16"])
def test_model_dtype_pools_store_the_converted_rows(pool_dtype, src_dtype):
    """No rotation, no scale: x.to(pool dtype), rounded to nearest even (exact bytes)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(9, 2, 48, generator=g).to(src_dtype), torch.randn(9, 2, 48, generator=g).to(src_dtype)
    slots = torch.tensor([4, 0, 17, 9, 3, 12, 1, 19, 6])
    ours, ref, _ = write_both(pool_dtype, k, v, slots, 20, seed=2)
    for a, b in zip(ours, ref):
        assert_same_bytes(a, b)
    torch.testing.assert_close(ours[1][slots].float(), v.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_strided_rows_from_a_packed_qkv_and_int32_slots(pool_dtype):
    """k and v as the model's split views of qkv [T, (H + 2 Hkv) D] (row stride (H + 2 Hkv) D);
    slots int32; a single token too."""
    g = torch.Generator().manual_seed(4)
    H, hkv, d = 6, 2, 64
    for T in (13, 1):
        qkv = torch.randn(T, (H + 2 * hkv) * d, generator=g).to(torch.bfloat16)
        k = qkv[:, H * d:(H + hkv) * d].view(T, hkv, d)
        v = qkv[:, (H + hkv) * d:].view(T, hkv, d)
        assert T == 1 or not k.is_contiguous()
        slots = torch.randperm(30, generator=g)[:T].to(torch.int32)
        ours, ref, _ = write_both(pool_dtype, k, v, slots, 30, seed=T)
        for a, b in zip(ours, ref):
            assert_same_bytes(a, b)


def test_nothing_to_write_is_a_no_op():
    pool = torch.zeros(4, 2, 8, dtype=torch.float8_e4m3fn)
    empty = torch.zeros(0, 2, 8)
    kv_write.write_kv_(pool, pool.clone(), empty, empty, torch.zeros(0, dtype=torch.int64))
    assert not pool.view(torch.uint8).any()


def test_reads_back_what_was_written():
    """Widened, scaled and rotated back (H is its own inverse), the FP8 rows are the inputs to
    within e4m3's rounding: the kernel stores K, not just some bytes the reference agrees with."""
    g = torch.Generator().manual_seed(8)
    k = torch.randn(5, 2, 64, generator=g)
    pool = torch.zeros(8, 2, 64, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([7, 0, 3, 5, 1])
    kv_write.write_kv_(pool, pool.clone(), k, k, slots)
    back = hadamard_rotate(pool[slots].float() * FP8_KV_SCALES[torch.float8_e4m3fn])
    torch.testing.assert_close(back, k, atol=0.15, rtol=0.07)
    assert torch.equal(pool[slots].view(torch.uint8), quantize_kv(k, pool.dtype).view(torch.uint8))


def _good():
    """Valid arguments: S 6, Hkv 2, D 8, T 3, float32 rows into an e4m3 pool."""
    return dict(k_cache=torch.zeros(6, 2, 8, dtype=torch.float8_e4m3fn),
                v_cache=torch.zeros(6, 2, 8, dtype=torch.float8_e4m3fn),
                k=torch.zeros(3, 2, 8), v=torch.zeros(3, 2, 8), slots=torch.tensor([0, 5, 2]))


@pytest.mark.parametrize("change, match", [
    (dict(k_cache=torch.zeros(6, 2, 8, dtype=torch.float64)), "pool dtype"),
    (dict(k_cache=torch.zeros(6, 16)), r"\[S, Hkv, D\]"),
    (dict(v_cache=torch.zeros(6, 2, 8, dtype=torch.float8_e5m2)), "must match k_cache"),
    (dict(k_cache=torch.zeros(6, 8, 2, dtype=torch.float8_e4m3fn).transpose(1, 2),
          v_cache=torch.zeros(6, 8, 2, dtype=torch.float8_e4m3fn).transpose(1, 2)), "contiguous"),
    (dict(k=torch.zeros(3, 2, 8, dtype=torch.float64), v=torch.zeros(3, 2, 8, dtype=torch.float64)), "one dtype"),
    (dict(v=torch.zeros(3, 2, 8, dtype=torch.bfloat16)), "one dtype"),
    (dict(k=torch.zeros(3, 1, 8), v=torch.zeros(3, 1, 8)), r"\(Hkv, D\)"),
    (dict(k=torch.zeros(3, 8, 2).transpose(1, 2)), "contiguous last dim"),
    (dict(slots=torch.tensor([0, 5, 2], dtype=torch.int16)), "int64/int32"),
    (dict(slots=torch.tensor([0, 5])), r"\[T = 3\]"),
    (dict(slots=torch.tensor([0, 0, 5, 5, 2, 2])[::2]), "contiguous"),
    (dict(slots=torch.tensor([0, 6, 2])), r"slots must lie in \[0, 6\)"),
    (dict(slots=torch.tensor([-1, 5, 2])), r"slots must lie in \[0, 6\)"),
    (dict(slots=torch.tensor([0, 5, 2], device="meta")), "move it first"),
], ids=["pool-dtype", "pool-shape", "v-pool", "pool-layout", "src-dtype", "mixed-dtype", "heads", "stride",
        "slot-dtype", "slot-count", "slot-stride", "slot-high", "slot-negative", "device"])
def test_bad_inputs_raise_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        kv_write.write_kv_(**{**_good(), **change})


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            kv_write.write_kv_(**_good())


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("pool, src, d", [("*u8", "*bf16", 128), ("*u8", "*fp32", 96), ("*bf16", "*fp32", 64)],
                         ids=["e4m3-bf16-d128", "e5m2-f32-d96", "bf16-pool"])
def test_compiles_for_the_gpu(pool, src, d, tmp_path):
    """The interpreter runs the kernel as Python; the compiler is stricter (the butterflies'
    reshapes and the integer encoding must lower). Built for sm_90 ahead of time, no GPU needed."""
    from kernels.kv_fp8 import hadamard_block, hadamard_norm

    fn = kv_write._kernel(False)
    fp8 = pool == "*u8"
    n = hadamard_block(d)
    types = {"k_ptr": src, "v_ptr": src, "kc_ptr": pool, "vc_ptr": pool, "slots_ptr": "*i64"}
    consts = dict(BLOCK_R=2048 // triton.next_power_of_2(d), BLOCK_D=triton.next_power_of_2(d), FP8=fp8,
                  HAD_LOG=n.bit_length() - 1, NORM=hadamard_norm(n), INV_SCALE=4.0 if d == 128 else 1.0,
                  MBITS=3 if d == 128 else 2, BIAS=7 if d == 128 else 15, MAX_CODE=0x7E if d == 128 else 0x7C,
                  ROUND_BF16=False)
    compiled = compile_for_sm90(fn, types, consts, tmp_path)
    assert compiled.asm["cubin"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pool_dtype", FP8 + [torch.bfloat16], ids=["e4m3", "e5m2", "bf16"])
def test_compiled_kernel_on_cuda(pool_dtype):
    """The compiled kernel's bytes equal the CPU reference's (so the GPU's float math rounds as
    torch's CPU conversion does; FMA contraction cannot touch add/sub butterflies and scalings)."""
    g = torch.Generator().manual_seed(12)
    T, hkv, d, S = 300, 8, 128, 1000
    k, v = spread_rows(T, hkv, d, torch.bfloat16, g), spread_rows(T, hkv, d, torch.bfloat16, g)
    slots = torch.randperm(S, generator=g)[:T]
    ref = [torch.zeros(S, hkv, d, dtype=pool_dtype) for _ in range(2)]
    kv_write.write_kv_reference(*ref, k, v, slots)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        pools = [torch.zeros(S, hkv, d, dtype=pool_dtype, device="cuda") for _ in range(2)]
        kv_write.write_kv_(*pools, k.cuda(), v.cuda(), slots.cuda())
    for a, b in zip(pools, ref):
        assert_same_bytes(a.cpu(), b)
