"""The LoRA hook on one Linear against a per-row torch reference: slots holding several segments
of a fused linear, rows grouped as slices and as index lists, every base path (F.linear,
prepacked bfloat16), and the stacks growing without disturbing what they hold."""
from __future__ import annotations

import pytest
import torch

from services.worker.lora.batch import LoraContext, group_rows
from services.worker.lora.stacked import StackedLora
from services.worker.model.linear import Linear, can_prepack


def test_group_rows():
    assert group_rows([(-1, 3), (-1, 2)], torch.device("cpu")) is None
    batch = group_rows([(0, 2), (0, 3), (-1, 1), (1, 4), (0, 1), (2, 0)], torch.device("cpu"))
    groups = dict(batch.groups)
    assert set(groups) == {0, 1} and groups[1] == slice(6, 10)
    assert groups[0].tolist() == [0, 1, 2, 3, 4, 10]  # the first two items' rows merged into one run


def _segments(g: torch.Generator, layout: list[tuple[int, int, int]], n_in: int) -> list:
    return [(lo, hi, torch.randn(r, n_in, generator=g), torch.randn(hi - lo, r, generator=g)) for lo, hi, r in layout]


def _reference(x: torch.Tensor, base: torch.Tensor, slot_of_row: list[int], slots: dict[int, list]) -> torch.Tensor:
    y = base.clone().float()
    for t, slot in enumerate(slot_of_row):
        for lo, hi, a, b in slots.get(slot, []):
            y[t, lo:hi] += b @ (a @ x[t].float())
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hook_matches_per_row_reference(dtype):
    g = torch.Generator().manual_seed(0)
    linear = Linear(32, 24, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 32, generator=g) / 6)
    linear = linear.to(dtype)
    if dtype == torch.bfloat16 and can_prepack(linear.weight):
        assert linear.prepack()
    context = LoraContext()
    stack = StackedLora(32, 24, 3, dtype, torch.device("cpu"), context)
    slots = {0: _segments(g, [(0, 8, 3), (16, 24, 2)], 32)}  # q and v of a fused qkv, k untargeted
    stack.write(0, [(lo, hi, a.to(dtype), b.to(dtype)) for lo, hi, a, b in slots[0]])
    slots[2] = _segments(g, [(0, 24, 7)], 32)  # wider: the stacks grow, slot 0 kept
    stack.write(2, [(lo, hi, a.to(dtype), b.to(dtype)) for lo, hi, a, b in slots[2]])
    assert stack.width == [5, 0, 7] and stack.a.shape == (3, 7, 32)
    spans = [(0, 2), (-1, 3), (2, 4), (0, 1), (1, 2)]  # slot 1 is empty: its rows get nothing
    slot_of_row = [s for s, n in spans for _ in range(n)]
    x = torch.randn(len(slot_of_row), 32, generator=g).to(dtype)
    base = linear(x)
    linear.lora = stack
    assert torch.equal(linear(x), base)  # no active batch: the base output
    context.batch = group_rows(spans, torch.device("cpu"))
    ours = linear(x)
    want = _reference(x, base, slot_of_row, slots)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(ours.float(), want, **tol)
    assert torch.equal(ours[2:5], base[2:5])  # base rows untouched, bit for bit
    stack.clear(0)
    assert torch.equal(linear(x)[:2], base[:2])
