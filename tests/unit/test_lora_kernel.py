"""The fused multi-LoRA CPU kernel (kernels/cpu/lora_apply.cpp) against its float32 torch
reference: random shapes (odd T, odd and ragged sizes), several slots of different widths and
segments, base-only rows left untouched, ranks up to the default --max-lora-rank, every dtype."""
from __future__ import annotations

import pytest

from tests.kernel_builds import built
import torch

from bench.common.random_adapter import make_random_adapter
from kernels import lora_cpu
from services.worker.config import WorkerConfig
from services.worker.lora.batch import LoraContext, group_rows
from services.worker.lora.stacked import StackedLora
from tests.unit.lora_fixtures import lora_runner, run_together, save_tiny_llama

MODULE = built(lora_cpu)
MAX_RANK = WorkerConfig.max_lora_rank


def _slots(g, num_slots, n_in, n_out, dtype, max_rank):
    """Per slot: segments splitting [0, n_out) into up to 3 modules, some untargeted, random
    ranks → packed a, b, segs and the widths."""
    bounds = sorted(torch.randint(1, n_out, (2,), generator=g).tolist())
    parts = [(0, bounds[0]), (bounds[0], bounds[1]), (bounds[1], n_out)]
    layouts = []
    for s in range(num_slots):
        if s == num_slots - 1:
            layouts.append([])  # an empty slot: its rows get nothing
            continue
        chosen = [p for p in parts if torch.rand((), generator=g) < 0.7] or [parts[0]]
        ranks = [int(torch.randint(1, max_rank + 1, (), generator=g)) for _ in chosen]
        layouts.append([(lo, hi, r) for (lo, hi), r in zip(chosen, ranks)])
    wp = lora_cpu.padded_width(max(1, max(sum(r for *_, r in lay) for lay in layouts)))
    a = torch.zeros(num_slots, (n_in + 1) // 2, wp, 2, dtype=dtype)
    b = torch.zeros(num_slots, wp // 2, n_out, 2, dtype=dtype)
    segs = torch.zeros(num_slots, 3, 4, dtype=torch.int32)
    for s, lay in enumerate(layouts):
        col = 0
        a_s, b_s = torch.zeros(wp, n_in), torch.zeros(n_out, wp)
        for j, (lo, hi, r) in enumerate(lay):
            a_s[col:col + r] = torch.randn(r, n_in, generator=g) / n_in ** 0.5
            b_s[lo:hi, col:col + r] = torch.randn(hi - lo, r, generator=g) / r ** 0.5
            segs[s, j] = torch.tensor([lo, hi, col, col + r])
            col += r
        a[s] = lora_cpu.pack_a(a_s.to(dtype), wp)
        b[s] = lora_cpu.pack_b(b_s.to(dtype), wp)
    return a, b, segs


def _rows(g, T, num_slots):
    """Each row: a slot or -1 (base) → order (rows grouped by slot) and groups."""
    slot_of = torch.randint(-1, num_slots, (T,), generator=g).tolist()
    order, groups = [], []
    for s in range(num_slots):
        rows = [t for t, x in enumerate(slot_of) if x == s]
        if rows:
            groups.append([s, len(order), len(order) + len(rows)])
            order += rows
    base = [t for t, x in enumerate(slot_of) if x < 0]
    return (torch.tensor(order, dtype=torch.int32), torch.tensor(groups, dtype=torch.int32).view(-1, 3), base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_matches_float32_reference(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 40, (), generator=g)) * 2 + 1  # odd
    n_in = [33, 64, 96, 129][seed]
    n_out = [40, 72, 200, 17 * 3][seed]
    num_slots = 2 + seed
    max_rank = MAX_RANK if seed == 3 else 16
    a, b, segs = _slots(g, num_slots, n_in, n_out, dtype, max_rank)
    order, groups, base_rows = _rows(g, T, num_slots)
    x = torch.randn(T, n_in, generator=g).to(dtype)
    y = torch.randn(T, n_out, generator=g).to(dtype)
    want = lora_cpu.lora_apply_reference(x, y, a, b, segs, order, groups)
    before = y.clone()
    lora_cpu.lora_apply_(x, y, a, b, segs, order, groups, MODULE)
    assert torch.equal(y[base_rows], before[base_rows])  # base-only rows untouched
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(y.float(), want, **tol)
    assert not torch.equal(y, before)  # something was added


def test_strided_rows_and_many_tokens():
    """x and y as column slices of wider tensors (row strides), a prefill-sized T in one slot."""
    g = torch.Generator().manual_seed(7)
    a, b, segs = _slots(g, 2, 64, 48, torch.bfloat16, 16)
    T = 301
    x_wide = torch.randn(T, 80, generator=g).to(torch.bfloat16)
    y_wide = torch.randn(T, 60, generator=g).to(torch.bfloat16)
    x, y = x_wide[:, 8:72], y_wide[:, 4:52]
    order = torch.arange(T, dtype=torch.int32)
    groups = torch.tensor([[0, 0, T]], dtype=torch.int32)
    want = lora_cpu.lora_apply_reference(x, y, a, b, segs, order, groups)
    lora_cpu.lora_apply_(x, y, a, b, segs, order, groups, MODULE)
    torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=1.6e-2)


def test_refuses_bad_arguments():
    a = torch.zeros(2, 4, 16, 2, dtype=torch.bfloat16)
    b = torch.zeros(2, 8, 8, 2, dtype=torch.bfloat16)
    segs = torch.zeros(2, 1, 4, dtype=torch.int32)
    x, y = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16)
    order = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="groups"):
        MODULE.lora_apply_(x, y, a, b, segs, order, torch.tensor([[2, 0, 2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="order"):
        MODULE.lora_apply_(x, y, a, b, segs, torch.tensor([0, 5], dtype=torch.int32),
                           torch.tensor([[0, 0, 2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="dtype"):
        MODULE.lora_apply_(x.float(), y, a, b, segs, order, torch.tensor([[0, 0, 2]], dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hook_on_the_kernel_matches_the_torch_path(dtype):
    """StackedLora with the kernel and without it (the torch reference path) on one mixed batch:
    several slots written, one cleared, rows spread over runs, base rows; a wider slot written
    last grows the kernel's layout without disturbing the others."""
    g = torch.Generator().manual_seed(11)
    context = LoraContext()
    n_in, n_out = 48, 40
    stacks = [StackedLora(n_in, n_out, 4, dtype, torch.device("cpu"), context, kernel) for kernel in (MODULE, None)]
    assert stacks[0].fused is not None and stacks[1].fused is None

    def segments(layout):
        return [(lo, hi, torch.randn(r, n_in, generator=g).to(dtype), torch.randn(hi - lo, r, generator=g).to(dtype))
                for lo, hi, r in layout]

    writes = [(0, segments([(0, 16, 4), (24, 40, 8)])), (1, segments([(0, 40, 16)])), (3, segments([(16, 24, 2)])),
              (2, segments([(0, 16, 20), (16, 24, 20), (24, 40, 20)]))]
    for stack in stacks:
        for slot, segs in writes:
            stack.write(slot, segs)
        stack.clear(3)
    spans = [(0, 3), (-1, 2), (2, 5), (1, 1), (0, 4), (3, 2), (-1, 1), (2, 2)]
    x = torch.randn(sum(n for _, n in spans), n_in, generator=g).to(dtype)
    base = torch.randn(x.shape[0], n_out, generator=g).to(dtype)
    context.batch = group_rows(spans, torch.device("cpu"))
    ours, theirs = (stack(x, base.clone()) for stack in stacks)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(ours.float(), theirs.float(), **tol)
    untouched = [3, 4, 15, 16, 17]  # base rows and slot 3's (cleared) rows
    assert torch.equal(ours[untouched], base[untouched])
    assert not torch.equal(ours, base)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_kernel")
    path, hf = save_tiny_llama(root / "base")
    dirs = {n: make_random_adapter(hf, str(root / n), r, 2 * r, seed=i + 1)
            for i, (n, r) in enumerate({"a": 8, "b": 16, "c": 5}.items())}
    return path, dirs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_on_the_kernel_matches_the_torch_path(tiny, dtype):
    """A mixed step (base rows, three adapters, one on two requests) and its decodes through the
    model runner: the same logits on the kernel as on the torch paths (set_fused_kernel(False))."""
    path, dirs = tiny
    adapters = {"r0": "a", "r1": "", "r2": "b", "r3": "c", "r4": "a"}
    requests = {rid: (torch.randint(0, 256, (7 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist(), ad)
                for i, (rid, ad) in enumerate(adapters.items())}
    chunks = {rid: [4 + i] for i, rid in enumerate(requests)}
    results = []
    for on in (True, False):
        runner = lora_runner(path, dirs, dtype=dtype)
        runner.loras.set_fused_kernel(on)
        assert all((s.fused is not None) and s.use_fused == on for s in runner.loras._stacks.values())
        results.append(run_together(runner, requests, chunks))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=0.1, rtol=0.05)
    for rid in requests:
        for (p, ours), (_, want) in zip(*(r[rid] for r in results)):
            torch.testing.assert_close(ours, want, **tol, msg=lambda m: f"{rid} position {p}: {m}")
