"""Prepacked (oneDNN) linears: the same numbers as F.linear, at every batch size."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.model.linear import Linear, can_prepack, prepack_refusal

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _needs_packing(dtype: torch.dtype) -> None:
    if prepack_refusal(dtype):
        pytest.skip(f"this CPU does not prepack {dtype}: {prepack_refusal(dtype)}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain_linear(dtype, bias):
    """Where the CPU cannot pack the dtype (fp16 without AVX512-FP16, as on an AMD EPYC), the
    layer says so and computes with F.linear; either way the numbers are F.linear's."""
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    assert layer.prepack() == (prepack_refusal(dtype) is None)
    assert (layer.packed is None) == (prepack_refusal(dtype) is not None)
    for rows in (1, 3, 17, 64, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias)), rows


def test_packed_rows_do_not_depend_on_batch_mates():
    _needs_packing(torch.bfloat16)
    torch.manual_seed(1)
    layer = Linear(64, 128, bias=False).to(torch.bfloat16)
    assert layer.prepack()
    x = torch.randn(48, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(48)])
        assert torch.equal(alone, layer(x))


def test_float32_and_repack_after_weight_change():
    layer = Linear(8, 8, bias=False)
    assert not can_prepack(layer.weight) and not layer.prepack() and layer.packed is None
    _needs_packing(torch.bfloat16)
    half = Linear(8, 8, bias=False).to(torch.bfloat16)
    half.prepack()
    with torch.no_grad():
        half.weight.mul_(2)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.inference_mode():
        stale = half(x)
        half.prepack()  # a weight update must repack, as the model's prepack_weights() does
        assert torch.equal(half(x), F.linear(x, half.weight))
        assert not torch.equal(stale, half(x))


def test_sharing_linear_computes_with_the_shared_parameter():
    """A tied LM head: the Linear holds the embedding's very parameter, so an update to one is
    an update to the other, and its logits are float32."""
    emb = torch.nn.Embedding(50, 16).to(torch.bfloat16)
    head = Linear.sharing(emb.weight)
    assert head.weight is emb.weight and head.bias is None
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        emb.weight.mul_(2)
    with torch.inference_mode():
        logits = head.logits(x)
        assert logits.dtype == torch.float32
        assert torch.equal(logits, F.linear(x, emb.weight).float())
