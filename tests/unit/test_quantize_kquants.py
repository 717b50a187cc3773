"""Our numpy k-quant quantizers (services/quantize/kquants.py) write ggml's exact block layouts:
`gguf.quants.dequantize` (the reference reader) reads their bytes back close to the input, every
sub-block on its own scale (a mispacked scale bit, or a nibble in the wrong place, breaks one
sub-block by far more than the bounds)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from services.quantize.kquants import QK_K, quantize_rows

QType = gguf.GGMLQuantizationType
# Relative RMS error bounds on N(0, 1) rows: measured Q4_K 0.0711, Q5_K 0.0357, Q6_K 0.0184, where
# gguf's own Q4_1 gives 0.0782 and Q5_1 0.0380 at more bits per weight (5 and 6 against 4.5 and 5.5).
RMS_BOUND = {"Q4_K": 0.074, "Q5_K": 0.037, "Q6_K": 0.0195}
NMAX = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}
SUB = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}


def _roundtrip(x: np.ndarray, qtype: str) -> np.ndarray:
    blocks = quantize_rows(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[QType[qtype]]
    assert blocks.dtype == np.uint8 and blocks.shape == (x.shape[0], x.shape[1] // block * size)
    return gguf.quants.dequantize(blocks, QType[qtype])


@pytest.mark.parametrize("qtype", sorted(NMAX))
def test_gaussian_rows_read_back_close(qtype):
    x = np.random.default_rng(0).standard_normal((32, 3 * QK_K)).astype(np.float32)
    y = _roundtrip(x, qtype)
    rel = np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean())
    assert rel < RMS_BOUND[qtype], rel


@pytest.mark.parametrize("qtype", sorted(NMAX))
def test_every_sub_block_keeps_its_own_scale(qtype):
    """Super-blocks whose magnitudes span 1e-3..1e1, sub-blocks within one at 0.25x-1x of each other
    and offset: each sub-block's worst error stays within about half its own quantization step, plus
    the rounding of its 6-bit (Q6_K: 8-bit) scale and min against the super-block's."""
    rng = np.random.default_rng(1)
    sub, nmax = SUB[qtype], NMAX[qtype]
    n_super, per = 16, QK_K // sub
    mags = (np.exp(rng.uniform(np.log(1e-3), np.log(10), n_super))[:, None]
            * rng.uniform(0.25, 1.0, (n_super, per))).astype(np.float32).reshape(-1)
    offsets = rng.uniform(-1, 1, mags.size).astype(np.float32) * mags
    x = (rng.standard_normal((mags.size, sub)) * mags[:, None] + offsets[:, None]).astype(np.float32)
    y = _roundtrip(x.reshape(1, -1), qtype).reshape(x.shape)
    span = (x.max(1) - np.minimum(x.min(1), 0)) if qtype != "Q6_K" else 2 * np.abs(x).max(1)
    top = np.repeat(span.reshape(n_super, per).max(1), per)
    worst = np.abs(y - x).max(1)
    assert (worst <= 0.6 * span / nmax + top / 63).all()


@pytest.mark.parametrize("qtype", sorted(NMAX))
def test_zero_and_constant_blocks(qtype):
    x = np.zeros((3, QK_K), dtype=np.float32)
    x[1] = 0.25
    x[2, ::2] = -3.0
    y = _roundtrip(x, qtype)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_allclose(y[1:], x[1:], atol=3.0 / 30)


def test_rows_not_whole_super_blocks_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_rows(np.zeros((2, 576), dtype=np.float32), "Q4_K")
