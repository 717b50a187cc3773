"""The Triton multi-LoRA SGMV kernel (kernels/triton/lora_sgmv.py) against the float32 torch
reference it shares with the CPU kernel (kernels/lora_cpu.lora_apply_reference), on CPU, under
Triton's interpreter (enabled per module with the knob, as tests/unit/test_triton_bitmask.py
explains). Small shapes: the interpreter runs every program as numpy."""
from __future__ import annotations

import pytest
import torch

from kernels import lora_cpu
from kernels.triton import lora_sgmv
from services.worker.lora import backend_select
from tests.unit.triton_aot import compile_for_sm90

import triton  # a declared dependency: never skipped


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        yield


def make_slots(g, num_slots: int, n_in: int, n_out: int, dtype, ranks: list[int]):
    """Slot s < num_slots - 1: up to three modules splitting [0, n_out), rank ranks[s % len] each
    (one left untargeted in odd slots); the last slot is empty → packed a, b, segs."""
    third = n_out // 3
    parts = [(0, third), (third, 2 * third), (2 * third, n_out)]
    layouts = []
    for s in range(num_slots - 1):
        chosen = parts if s % 2 == 0 else parts[::2]
        layouts.append([(lo, hi, ranks[s % len(ranks)]) for lo, hi in chosen])
    layouts.append([])  # an empty slot: its rows get nothing
    wp = lora_cpu.padded_width(max(sum(r for *_, r in lay) for lay in layouts))
    a = torch.zeros(num_slots, (n_in + 1) // 2, wp, 2, dtype=dtype)
    b = torch.zeros(num_slots, wp // 2, n_out, 2, dtype=dtype)
    segs = torch.zeros(num_slots, 3, 4, dtype=torch.int32)
    for s, lay in enumerate(layouts):
        a_s, b_s, col = torch.zeros(wp, n_in), torch.zeros(n_out, wp), 0
        for j, (lo, hi, r) in enumerate(lay):
            a_s[col:col + r] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            b_s[lo:hi, col:col + r] = torch.randn(hi - lo, r, generator=g) / r ** 0.5
            segs[s, j] = torch.tensor([lo, hi, col, col + r])
            col += r
        a[s], b[s] = lora_cpu.pack_a(a_s.to(dtype), wp), lora_cpu.pack_b(b_s.to(dtype), wp)
    return a, b, segs


def make_rows(g, T: int, num_slots: int):
    """Each row a random slot or -1 (base), every slot used → order, groups, base rows."""
    slot_of = torch.randint(-1, num_slots, (T,), generator=g).tolist()
    slot_of[:num_slots + 1] = list(range(-1, num_slots))
    order, groups = [], []
    for s in reversed(range(num_slots)):  # groups need not be sorted by slot
        rows = [t for t, x in enumerate(slot_of) if x == s]
        groups.append([s, len(order), len(order) + len(rows)])
        order += rows
    base = [t for t, x in enumerate(slot_of) if x < 0]
    return torch.tensor(order, dtype=torch.int32), torch.tensor(groups, dtype=torch.int32), base


TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
       torch.float16: dict(atol=4e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank, T, n_in, n_out, num_slots", [
    (8, 37, 33, 40, 3), (16, 21, 64, 72, 4), (64, 19, 48, 30, 2)], ids=["r8", "r16", "r64"])
def test_kernel_matches_the_float32_reference(dtype, rank, T, n_in, n_out, num_slots):
    g = torch.Generator().manual_seed(rank)
    a, b, segs = make_slots(g, num_slots, n_in, n_out, dtype, [rank, max(1, rank // 2)])
    order, groups, base = make_rows(g, T, num_slots)
    x = torch.randn(T, n_in, generator=g).to(dtype)
    y = torch.randn(T, n_out, generator=g).to(dtype)
    want = lora_sgmv.lora_apply_reference(x, y, a, b, segs, order, groups)
    before = y.clone()
    lora_sgmv.lora_apply_(x, y, a, b, segs, order, groups)
    assert base and torch.equal(y[base], before[base])  # base-only rows untouched
    empty = order[groups[0, 1]:groups[0, 2]].long()  # groups[0] is the empty (last) slot
    assert len(empty) and torch.equal(y[empty], before[empty])
    torch.testing.assert_close(y.float(), want, **TOL[dtype])
    assert (y.float() - before.float()).abs().max() > 10 * TOL[dtype]["atol"]  # something was added


def test_strided_rows_a_long_slot_and_uncovered_columns():
    """x and y as column slices of wider tensors; one slot's 40 rows span three row tiles; output
    columns no segment covers keep their exact bits (-0.0 included)."""
    g = torch.Generator().manual_seed(5)
    a, b, segs = make_slots(g, 2, 20, 36, torch.bfloat16, [8])
    segs[0, 1] = 0  # the middle module untargeted: columns 12..23 covered by nothing
    x_wide, y_wide = torch.randn(41, 30, generator=g).to(torch.bfloat16), torch.randn(41, 50).to(torch.bfloat16)
    y_wide[:, 16] = -0.0
    x, y = x_wide[:, 3:23], y_wide[:, 2:38]
    order = torch.arange(1, 41, dtype=torch.int32)
    groups = torch.tensor([[0, 0, 40]], dtype=torch.int32)
    before, want = y_wide.clone(), lora_sgmv.lora_apply_reference(x, y, a, b, segs, order, groups)
    lora_sgmv.lora_apply_(x, y, a, b, segs, order, groups)
    torch.testing.assert_close(y.float(), want, **TOL[torch.bfloat16])
    assert torch.equal(y_wide[0], before[0])  # row 0 is not listed
    assert torch.equal(y[:, 12:24], before[:, 14:26]) and torch.signbit(y_wide[:, 16].float()).all()
    assert torch.equal(y_wide[:, :2], before[:, :2]) and torch.equal(y_wide[:, 38:], before[:, 38:])


def test_nothing_to_apply_is_a_no_op():
    a, b = torch.zeros(2, 4, 0, 2), torch.zeros(2, 0, 8, 2)  # no slot written yet: Wp = 0
    segs = torch.zeros(2, 0, 4, dtype=torch.int32)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    before = y.clone()
    lora_sgmv.lora_apply_(x, y, a, b, segs, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 3, dtype=torch.int32))
    assert torch.equal(y, before)


def _good():
    """Valid arguments: 2 slots, in 8, out 8, Wp 16, T 3, rows 0 and 1 in slot 0."""
    return dict(x=torch.zeros(3, 8), y=torch.zeros(3, 8), a=torch.zeros(2, 4, 16, 2), b=torch.zeros(2, 8, 8, 2),
                segs=torch.tensor([[[0, 8, 0, 4]], [[0, 0, 0, 0]]], dtype=torch.int32),
                order=torch.tensor([0, 1], dtype=torch.int32), groups=torch.tensor([[0, 0, 2]], dtype=torch.int32))


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 8, dtype=torch.float64), y=torch.zeros(3, 8, dtype=torch.float64)), "float32/bfloat16"),
    (dict(y=torch.zeros(3, 8, dtype=torch.bfloat16)), "one dtype"),
    (dict(y=torch.zeros(4, 8)), "3 rows, y 4"),
    (dict(x=torch.zeros(8, 3).t()), "contiguous last dim"),
    (dict(a=torch.zeros(2, 5, 16, 2)), r"ceil\(in/2\) = 4"),
    (dict(b=torch.zeros(2, 8, 9, 2)), "b must be"),
    (dict(a=torch.zeros(2, 4, 16, 2, dtype=torch.bfloat16)), "x's dtype"),
    (dict(segs=torch.zeros(3, 1, 4, dtype=torch.int32)), "segs must be"),
    (dict(order=torch.tensor([0, 1])), "order must be int32"),
    (dict(groups=torch.tensor([0, 0, 2], dtype=torch.int32)), r"groups \[G, 3\]"),
    (dict(a=torch.zeros(2, 16, 4, 2).transpose(1, 2)), "a must be contiguous"),
    (dict(order=torch.tensor([0, 3], dtype=torch.int32)), "distinct rows"),
    (dict(order=torch.tensor([1, 1], dtype=torch.int32)), "distinct rows"),
    (dict(groups=torch.tensor([[2, 0, 2]], dtype=torch.int32)), "out of range"),
    (dict(groups=torch.tensor([[0, 0, 3]], dtype=torch.int32)), "out of range"),
    (dict(segs=torch.tensor([[[0, 9, 0, 4]], [[0, 0, 0, 0]]], dtype=torch.int32)), "segs need"),
    (dict(segs=torch.tensor([[[0, 8, 0, 17]], [[0, 0, 0, 0]]], dtype=torch.int32)), "segs need"),
    (dict(order=torch.tensor([0, 1], dtype=torch.int32, device="meta")), "move it first"),
], ids=["dtype", "mixed-dtype", "rows", "stride", "a-shape", "b-shape", "a-dtype", "segs-shape", "order-dtype",
        "groups-shape", "a-layout", "order-range", "order-repeat", "slot-range", "group-range", "seg-rows",
        "seg-cols", "device"])
def test_bad_inputs_raise_value_error(change, match):
    with pytest.raises(ValueError, match=match):
        lora_sgmv.lora_apply_(**{**_good(), **change})


def test_cpu_tensors_need_the_interpreter():
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="needs a CUDA device"):
            lora_sgmv.lora_apply_(**_good())


def test_the_check_catches_a_broken_kernel():
    """Not tautological: the reference tells a delta on the wrong rank columns or missing the
    last segment apart from the right one at the tolerance used above."""
    g = torch.Generator().manual_seed(3)
    a, b, segs = make_slots(g, 2, 16, 24, torch.float32, [8])
    order, groups, _ = make_rows(g, 9, 2)
    x, y = torch.randn(9, 16, generator=g), torch.randn(9, 24, generator=g)
    good = lora_sgmv.lora_apply_reference(x, y, a, b, segs, order, groups)
    shifted, short = segs.clone(), segs.clone()
    shifted[0, :, 2:] = (shifted[0, :, 2:] + 1).clamp(max=a.shape[2])
    short[0, 2] = 0
    for bad in (shifted, short):
        wrong = lora_sgmv.lora_apply_reference(x, y, a, b, bad, order, groups)
        assert not torch.allclose(wrong, good, **TOL[torch.float32])


@pytest.mark.slow  # an ahead-of-time sm_90 compile: seconds each
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("dtype, precision", [("*bf16", "tf32"), ("*fp32", "ieee")])
def test_compiles_for_the_gpu(dtype, precision, tmp_path):
    """The interpreter runs the kernels as Python; the compiler is stricter. Both built for sm_90
    ahead of time, no GPU needed (triton ships ptxas)."""
    shrink, expand = lora_sgmv._kernels(False)
    common = {"h_ptr": "*fp32", "segs_ptr": "*i32", "order_ptr": "*i32", "groups_ptr": "*i32", "n_groups": "i32",
              "wp": "i32", "n_seg": "i32", "BLOCK_M": "constexpr", "PRECISION": "constexpr", "UPCAST": "constexpr"}
    builds = [
        (shrink, {"x_ptr": dtype, "x_stride": "i64", "a_ptr": dtype, "n_in": "i32", "BLOCK_K": "constexpr",
                  "BLOCK_W": "constexpr"}, {"BLOCK_K": 64, "BLOCK_W": 64}),
        (expand, {"y_ptr": dtype, "y_stride": "i64", "b_ptr": dtype, "n_out": "i32", "BLOCK_R": "constexpr",
                  "BLOCK_N": "constexpr"}, {"BLOCK_R": 16, "BLOCK_N": 64}),
    ]
    for fn, own, consts in builds:
        constexprs = {"BLOCK_M": 16, "PRECISION": precision, "UPCAST": False, **consts}
        compiled = compile_for_sm90(fn, own | common, constexprs, tmp_path)
        assert compiled.asm["cubin"]


def test_backend_selection():
    """CPU: the C++ kernel (or None where it cannot build), unchanged; CUDA: this Triton kernel;
    anything else: the torch paths."""
    assert backend_select.fused_kernel(torch.device("cpu")) is lora_cpu.load()
    assert backend_select.fused_kernel(torch.device("cuda")) is lora_sgmv
    assert backend_select.fused_kernel(torch.device("meta")) is None
    assert backend_select.serves(lora_sgmv, torch.device("cuda")) and not backend_select.serves(
        lora_sgmv, torch.device("cpu"))
    cpu_module = lora_cpu.load()
    if cpu_module is not None:
        assert backend_select.serves(cpu_module, torch.device("cpu"))
        assert not backend_select.serves(cpu_module, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_kernel_on_cuda(dtype):
    g = torch.Generator().manual_seed(11)
    a, b, segs = make_slots(g, 5, 256, 384, dtype, [16, 64, 8])
    order, groups, base = make_rows(g, 203, 5)
    x, y = torch.randn(203, 256, generator=g).to(dtype), torch.randn(203, 384, generator=g).to(dtype)
    want = lora_sgmv.lora_apply_reference(x, y, a, b, segs, order, groups)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        args = [t.cuda() for t in (x, y, a, b, segs, order, groups)]
        lora_sgmv.lora_apply_(*args)
    out = args[1].cpu()
    assert torch.equal(out[base], y[base])
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
