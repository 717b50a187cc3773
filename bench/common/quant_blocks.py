"""Random valid GGUF quantized weights, per format (kernels/quant_formats.py): the blocks the
quantized-kernel tests (tests/unit/test_quant_formats.py, test_int8_activations.py) and
bench/quant_kernels.py compute on."""
from __future__ import annotations

import numpy as np
import torch

from kernels.quant_formats import FORMATS
from kernels.quant_gemv import QuantWeight


def random_blocks(qtype: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """Valid random GGUF rows uint8 [N, K / block * type_size]: every byte random except the
    fp16 super-scales, set to small finite values (random bytes could be inf/NaN)."""
    f = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (N * K // f.block, f.type_size), dtype=np.uint8)

    def halves(n: int) -> np.ndarray:
        return (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint8).reshape(n, 2)

    fp16_at = {"Q6_K": [208], "Q8_0": [0], "Q4_0": [0], "Q5_0": [0]}.get(qtype, [0, 2])
    for at in fp16_at:
        b[:, at:at + 2] = halves(b.shape[0])
    return b.reshape(N, -1)


def weight(qtype: str, N: int, K: int, seed: int = 0) -> QuantWeight:
    """A random [N, K] QuantWeight: random valid blocks of a GGUF format, or int8 per-channel of a
    random normal matrix."""
    if qtype == "int8":
        return QuantWeight.int8_per_channel(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)))
    return QuantWeight.from_blocks(torch.from_numpy(random_blocks(qtype, N, K, seed)), qtype)
