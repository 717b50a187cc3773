"""Quantized-only linears and embeddings (--quantization gguf / int8): each computes what its
dequantized weight would (within the float32 kernel's rounding), holds no dense weight, and
refuses what it cannot do with a message saying what to do."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from tests.kernel_builds import built
import torch
import torch.nn.functional as F

from kernels import quant_gemv
from kernels.quant_gemv import QuantWeight
from services.worker.config import WorkerConfig
from services.worker.model.linear import Linear
from services.worker.model.quant_embedding import QuantEmbedding
from services.worker.model.quant_parts import QuantParts, fuse, select_rows
from services.worker.model.weight_bytes import resident_weight_bytes

KERNEL = built(quant_gemv)
# Formats gguf can quantize (k-quants: B's tests cover them from real blocks); int8 is made here.
GGUF_FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def quant(n: int, k: int, qtype: str, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1  # [N, K]
    if qtype == "int8":
        return QuantWeight.int8_per_channel(w)
    blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])  # uint8 [N, row bytes]
    return QuantWeight.from_blocks(torch.from_numpy(np.ascontiguousarray(blocks)), qtype)


def quant_only_linear(q, bias: bool = False, dtype=torch.float32) -> Linear:
    layer = Linear(q.shape[1], q.shape[0], bias=bias).to(dtype)
    layer.set_quant_only(q, KERNEL)
    return layer


def reference(x: torch.Tensor, q, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), q.dequantize(), None if bias is None else bias.float())


@pytest.mark.parametrize("qtype", [*GGUF_FORMATS, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_only_linear_equals_its_dequantized_weight_at_every_batch_size(qtype, dtype):
    q = quant(96, 128, qtype)
    layer = quant_only_linear(q, bias=True, dtype=dtype)
    assert layer.quant_only and layer.weight.is_meta and layer.weight.shape == (96, 128)
    assert layer.prepack() and layer.packed is None  # nothing dense to pack
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    for rows in (1, 3, 8, 9, 64, 200):  # fused dot products and dequantized tiles
        x = torch.randn(rows, 128).to(dtype)
        with torch.inference_mode():
            y = layer(x)
            assert y.dtype == dtype and y.shape == (rows, 96)
            torch.testing.assert_close(y.float(), reference(x, q, layer.bias), **tol, msg=f"{qtype} {rows} rows")
            torch.testing.assert_close(layer.logits(x), reference(x, q, layer.bias), **tol)


def test_mixed_formats_fuse_into_parts_with_the_bias_split():
    """A Q4_K_M-style fused qkv: q and k in one format, v in another."""
    parts = [quant(64, 128, "Q4_1", 1), quant(32, 128, "Q4_1", 2), quant(32, 128, "Q8_0", 3)]
    fused = fuse(parts)
    assert isinstance(fused, QuantParts) and fused.shape == (128, 128) and fused.qtype == "Q4_1+Q8_0"
    assert fused.nbytes == sum(p.nbytes for p in parts)
    same = fuse(parts[:2])
    assert isinstance(same, QuantWeight) and same.shape == (96, 128)
    layer = quant_only_linear(fused, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    for rows in (1, 33):
        x = torch.randn(rows, 128)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), reference(x, fused, layer.bias), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="input sizes"):
        fuse([quant(32, 64, "Q8_0"), quant(32, 128, "Q8_0")])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "int8"])
def test_quant_embedding_dequantizes_only_the_rows_it_reads(qtype):
    q = quant(200, 64, qtype)
    emb = QuantEmbedding(q, torch.bfloat16)
    ids = torch.tensor([[5, 7, 5], [199, 0, 7]])
    out = emb(ids)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16 and emb.weight.is_meta
    assert torch.equal(out, q.dequantize()[ids].to(torch.bfloat16))
    assert torch.equal(select_rows(q, torch.tensor([3, 1])).dequantize(), q.dequantize()[[3, 1]])


def test_set_quant_refusals_are_clear():
    layer = Linear(64, 32, bias=False)
    with pytest.raises(ValueError, match="does not match"):
        layer.set_quant_only(quant(48, 64, "Q8_0"), KERNEL)
    with pytest.raises(ValueError, match="kernel is not built"):
        layer.set_quant_only(quant(32, 64, "Q8_0"), None)
    layer.set_quant_only(quant(32, 64, "Q8_0"), KERNEL)
    with pytest.raises(ValueError, match="set_quant_only"):
        layer.set_quant(None, 0)  # a quantized-only layer cannot drop its only weights
    with pytest.raises(NotImplementedError, match="meta"):
        layer.weight.detach().to("cpu")  # the meta weight holds no values to read


def test_tied_head_shares_the_embedding_blocks_and_counts_once():
    q = quant(256, 64, "Q8_0")
    model = torch.nn.Module()
    model.embed_tokens = QuantEmbedding(q, torch.float32)
    model.lm_head = Linear.sharing(model.embed_tokens.weight)
    model.lm_head.set_quant_only(q, KERNEL)
    model.norm = torch.nn.Parameter(torch.ones(64))
    assert model.lm_head.weight is model.embed_tokens.weight  # still tied
    assert resident_weight_bytes(model) == q.nbytes + 64 * 4


def test_dense_linear_bytes_count_the_prepacked_copy():
    layer = Linear(64, 32, bias=False).to(torch.bfloat16)
    packed = layer.prepack()
    assert resident_weight_bytes(layer) == 64 * 32 * 2 * (2 if packed else 1)


def test_config_refuses_unknown_formats_and_gpus():
    assert WorkerConfig(quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="auto, none, gguf, int8"):
        WorkerConfig(quantization="q4_k")
    with pytest.raises(ValueError, match="CPU kernels"):
        WorkerConfig(quantization="gguf", device="cuda")
