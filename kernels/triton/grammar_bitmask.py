"""The grammar token bitmask applied to logits on the GPU (structured outputs), and its torch
reference.

apply_token_bitmask_(logits [B, V], bitmask [B, W] int32, rows): for each listed row b,
logits[b, t] = -inf wherever bit t % 32 of bitmask[b, t // 32] is 0, in place; other rows are
untouched. One program per (listed row, block of words): it loads the words, expands them to
bits and stores -inf only where a bit is 0, so allowed logits are never read or written.

Vocabulary padding: the bitmask must cover every logits column (V <= 32 W); bits past V are
ignored. xgrammar instead masks only min(V, 32 W) columns and leaves the rest allowed (with a
warning). The worker sizes its bitmask to the logits' width (services/worker/grammar_vocab.py:
padded ids get b"", never allowed), so a narrower bitmask is a bug and is refused here rather
than letting padded ids be sampled.

Triton is imported on first use, not with this module: the scheduler imports the grammar
backend without ever masking, and the reference needs only torch.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from kernels.triton import import_triton, jitted

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_WORDS = 64  # words per program: 2048 tokens


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [B, V] float32/bfloat16/float16 (rows may be strided, the last dim contiguous) on
    a CUDA device, bitmask [B, W] int32 on the same device (last dim contiguous, V <= 32 W),
    rows: indices into B (any order). -inf in place where a listed row's bit is 0.
    CPU tensors are accepted only under the interpreter (TRITON_INTERPRET=1).
    Raises ValueError on a bad shape, stride, dtype, device or row; RuntimeError without triton."""
    triton = _triton()
    _check(logits, bitmask, rows)
    if not logits.is_cuda and not (logits.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"logits are on {logits.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    if not rows or logits.shape[1] == 0:
        return
    index = torch.tensor(rows, dtype=torch.int32, device=logits.device)  # [R]
    grid = (len(rows), triton.cdiv(triton.cdiv(logits.shape[1], 32), _BLOCK_WORDS))
    _kernel(triton.knobs.runtime.interpret)[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), index, logits.shape[1], BLOCK_WORDS=_BLOCK_WORDS)


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The same in torch, on any device: unpack the listed rows' words to bits, fill where 0."""
    _check(logits, bitmask, rows)
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # [R]
    words = bitmask[index]  # [R, W]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]: bit j of word w = token 32 w + j
    forbidden = (bits == 0).flatten(1)[:, :logits.shape[1]]  # [R, V]
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The contract both paths share, as ValueErrors a caller can act on."""
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be [B, V] float32/bfloat16/float16, got {list(logits.shape)} {logits.dtype}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits need a contiguous last dim, got strides {logits.stride()}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [B, W] int32, got {list(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        raise ValueError(f"bitmask needs a contiguous last dim, got strides {bitmask.stride()}")
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]}: they must match")
    if logits.shape[1] > 32 * bitmask.shape[1]:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words covers {32 * bitmask.shape[1]} tokens, "
                         f"logits have {logits.shape[1]}: allocate it for the logits' full (padded) width")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}: move it first")
    bad = [r for r in rows if not 0 <= r < logits.shape[0]]
    if bad:
        raise ValueError(f"rows {bad} out of range for a batch of {logits.shape[0]}")


def _triton() -> Any:
    return import_triton("grammar bitmask", "apply_token_bitmask_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _mask_rows_source)[0]


def _mask_rows_source(tl: Any) -> Any:
    """The kernel's Python function, defined here so `tl` is in its scope without importing
    triton at module level (triton reads closure variables as it reads globals)."""

    def mask_rows(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, vocab,
                  BLOCK_WORDS: tl.constexpr):
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
        word = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BW]
        bit = tl.arange(0, 32)  # [32]
        token = word[:, None] * 32 + bit[None, :]  # [BW, 32]
        # -1 (all allowed) past the last word V needs: wider bitmasks' extra words are not read
        words = tl.load(bitmask_ptr + row * bitmask_stride + word, mask=word * 32 < vocab, other=-1)
        forbidden = (((words[:, None] >> bit[None, :]) & 1) == 0) & (token < vocab)  # [BW, 32]
        neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + token, neg_inf, mask=forbidden)

    return mask_rows
