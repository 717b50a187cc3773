"""Top-k / top-p / min-p sampling from probabilities on the GPU, without sorting, and its torch
reference. services/worker/sampling.py runs it for CUDA logits when a batch filters.

sample_from_probs(probs [B, V] float32, top_ks, top_ps, min_ps, seeds, sample_indices) keeps, per
row, the tokens services/worker/sampling.py's filters keep and draws one of them by Gumbel-max
with the same counter-based noise, so a tie-free row gives the token the CPU sampler gives for
the same (seed, sample index), whatever its batch. The kept set, in order:
  top_k (k <= 0 or k >= V: off): the k most likely tokens;
  top_p (>= 1: off): over the top_k survivors renormalised by S, the mass of exactly k tokens
    (the row's total mass when top_k is off), the most-likely-first prefix whose mass reaches
    top_p: the token at sorted position j stays iff the mass before it is < top_p * S (the first
    always stays);
  min_p (<= 0: off): then only tokens with p >= min_p * p_max.
Ties at a cut all stay, as sampling.py's _candidates documents: the result is the threshold
"p >= the last kept token's p". Within a tie group the positions count one by one (top_k's k,
top_p's "mass before"), so a group that straddles a cut is kept whole, and S holds exactly k tokens
even when the k-th ties with the (k+1)-th. (sampling.py itself departs from this when every row of
a batch filters: it then draws among torch.topk's K ids only, K = the widest top_k, and the k-th's
ties past them are dropped.) The draw is argmax over kept tokens of log p + Gumbel(seed, index,
id), first index on equal scores.

No sort: each row is one program that finds the threshold by search over probability values.
A pass over V counts the tokens above PIVOTS pivot values, sums their mass, and finds the tokens
next to each pivot; pivots are spread over the bit patterns of non-negative float32 (ordered like
the values, and spread like their logarithm), so a pass narrows the search 16-fold and 31 bits
take at most 8 passes. The ends then snap to the nearest token values (the predicate only changes
at a token), so a search stops once one value is left between them, or when its answer is known
early (top_k: exactly k tokens above the lower end). Passes: 1 (max, total) + up to 8 (the top_k
cut, searched only for S when top_p also applies) + up to 8 (the cut) + 1 (the draw); 2 to 8
searching passes in all on random rows of 7 to 20000 tokens. min_p needs no search (p_max is
known after the first pass) and bounds the cut's search from below. One program per row: a
small batch keeps only B SMs busy (no split of a row across programs yet).

Differences from sampling.py, all in float rounding: that path cuts on logits and its own
cumulative sums, this one on probabilities and float32 block sums; a token within ~1e-6 of a cut,
or two scores within ~1e-6 of each other, may go the other way. The noise itself is bit-identical
(the kernel writes it to noise_out on request; the tests compare it with
services/worker/sampling.counter_uniform). Kernels import no service, hence the hash is written
here again, in torch (counter_uniform_reference, used by the reference) and in Triton.

Triton is imported on first use, as in grammar_bitmask.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from kernels.triton import import_triton, jitted

BLOCK = 512  # tokens per step of a pass
PIVOTS = 16  # probability values tested per pass
# splitmix64, as services/worker/sampling.py uses it (signed int64: torch multiplies wrapping).
_GOLDEN, _MUL1, _MUL2 = 0x9E3779B97F4A7C15 - 2**64, 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64


@dataclass
class Draw:
    """One draw per row. sample() needs only the tokens: its logprobs come from the raw logits."""

    token_ids: torch.Tensor  # [B] int64
    kept_min: torch.Tensor  # [B] float32: the smallest kept p; a token is kept iff p >= it


def sample_from_probs(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                      seeds: torch.Tensor, sample_indices: torch.Tensor,
                      noise_out: torch.Tensor | None = None) -> Draw:
    """probs [B, V] float32 >= 0 (softmax of the tempered logits; rows may be strided, the last dim
    contiguous), top_ks [B] int64, top_ps [B] float32, min_ps [B] float32, seeds [B] int64,
    sample_indices [B] int64, contiguous, on one CUDA device (CPU tensors only under
    TRITON_INTERPRET=1). Filters and draws as the module docstring says; probs are not modified.
    noise_out: None, or a contiguous [B, V] float32 tensor that receives the uniform noise u the
    draw used for every token (so tests see the kernel's own hash; it costs a write of [B, V]).
    Raises ValueError on a bad shape, stride, dtype or device; RuntimeError without triton."""
    triton = _triton()
    _check(probs, top_ks, top_ps, min_ps, seeds, sample_indices)
    if not probs.is_cuda and not (probs.device.type == "cpu" and triton.knobs.runtime.interpret):
        raise ValueError(f"probs are on {probs.device}: the Triton kernel needs a CUDA device "
                         "(or CPU tensors with TRITON_INTERPRET=1)")
    B, V = probs.shape
    if noise_out is not None and (list(noise_out.shape) != [B, V] or noise_out.dtype != torch.float32
                                  or not noise_out.is_contiguous() or noise_out.device != probs.device):
        raise ValueError(f"noise_out must be contiguous [{B}, {V}] float32 on {probs.device}, "
                         f"got {list(noise_out.shape)} {noise_out.dtype} on {noise_out.device}")
    out = Draw(torch.zeros(B, dtype=torch.int64, device=probs.device),
               torch.full((B,), float("inf"), dtype=torch.float32, device=probs.device))
    if B == 0 or V == 0:
        return out
    _kernel(triton.knobs.runtime.interpret)[(B,)](
        probs, probs.stride(0), top_ks, top_ps, min_ps, seeds, sample_indices, out.token_ids, out.kept_min,
        out.kept_min if noise_out is None else noise_out, V, BLOCK=BLOCK, PIVOTS=PIVOTS,
        WRITE_NOISE=noise_out is not None)
    return out


def counter_uniform_reference(seeds: torch.Tensor, sample_indices: torch.Tensor,
                              token_ids: torch.Tensor) -> torch.Tensor:
    """Element token + 1 of the splitmix64 stream keyed by (seed, index), its top 23 bits read as
    a signed number, + 2**22 + 1/2, over 2**23: [B] int64, [B] int64, [N] int64 -> [B, N]
    float32 in (0, 1), every step exact."""
    def shr(z: torch.Tensor, s: int) -> torch.Tensor:  # logical: torch's >> on int64 is arithmetic
        return (z >> s) & ((1 << (64 - s)) - 1)

    def mix(z: torch.Tensor) -> torch.Tensor:
        z = (z ^ shr(z, 30)) * _MUL1
        z = (z ^ shr(z, 27)) * _MUL2
        return z ^ shr(z, 31)

    key = mix(mix(seeds + _GOLDEN) ^ sample_indices)  # [B]
    z = mix(key[:, None] + (token_ids[None, :] + 1) * _GOLDEN)  # [B, N]
    return ((z >> 41).float() + (2**22 + 0.5)) * 2.0 ** -23


def sample_from_probs_reference(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                                min_ps: torch.Tensor, seeds: torch.Tensor, sample_indices: torch.Tensor) -> Draw:
    """The same contract in torch on any device, by a full sort of each row (float64 sums)."""
    _check(probs, top_ks, top_ps, min_ps, seeds, sample_indices)
    B, V = probs.shape
    if B == 0 or V == 0:
        return Draw(torch.zeros(B, dtype=torch.int64, device=probs.device),
                    torch.full((B,), float("inf"), device=probs.device))
    p, _ = probs.sort(dim=-1, descending=True)  # [B, V]
    pos = torch.arange(V, device=probs.device)
    k = torch.where((top_ks > 0) & (top_ks < V), top_ks, V)  # [B]
    within_k = pos[None, :] < k[:, None]
    mass = p.double().masked_fill(~within_k, 0.0)
    before = mass.cumsum(dim=-1) - mass  # [B, V] mass before each sorted position
    target = top_ps.double() * mass.sum(dim=-1)  # top_p of S
    stays = within_k & ((before < target[:, None]) | (top_ps >= 1.0)[:, None])
    n_keep = stays.sum(dim=-1).clamp(min=1)
    cut = p.gather(1, (n_keep - 1)[:, None]).squeeze(1)  # the last kept position's p: its ties stay
    cut = torch.maximum(cut, torch.where(min_ps > 0, min_ps * p[:, 0], 0.0))
    keep = probs >= cut[:, None]
    gumbel = -(-counter_uniform_reference(seeds, sample_indices, pos).log()).log()
    scores = (probs.log() + gumbel).masked_fill(~keep, float("-inf"))
    return Draw(scores.argmax(dim=-1), probs.masked_fill(~keep, float("inf")).min(dim=-1).values)


def _check(probs, top_ks, top_ps, min_ps, seeds, sample_indices) -> None:
    """The contract both paths share, as ValueErrors a caller can act on (no device sync)."""
    if probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError(f"probs must be [B, V] float32, got {list(probs.shape)} {probs.dtype}")
    if probs.shape[1] > 1 and probs.stride(1) != 1:
        raise ValueError(f"probs need a contiguous last dim, got strides {probs.stride()}")
    for name, t, dtype in (("top_ks", top_ks, torch.int64), ("top_ps", top_ps, torch.float32),
                           ("min_ps", min_ps, torch.float32), ("seeds", seeds, torch.int64),
                           ("sample_indices", sample_indices, torch.int64)):
        if list(t.shape) != [probs.shape[0]] or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{probs.shape[0]}] {dtype}, got {list(t.shape)} {t.dtype}")
        if t.device != probs.device:
            raise ValueError(f"{name} is on {t.device}, probs on {probs.device}: move it first")


def _triton() -> Any:
    return import_triton("top-k/top-p/min-p sampling", "sample_from_probs_reference")


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel for this interpreter setting (kernels.triton.jitted says why one per setting)."""
    return jitted(interpret, _sample_source)[0]


def _sample_source(tl: Any) -> Any:
    def sample(probs_ptr, probs_stride, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, index_ptr, token_ptr,
               kept_min_ptr, noise_ptr, vocab, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
               WRITE_NOISE: tl.constexpr):
        """One row: its max and mass, the cut's search, then the draw. Helpers are inlined and
        reductions spelt tl.reduce(x, 0, tl.standard.<combine>): the interpreter neither resolves a
        jitted helper held in a closure nor runs tl.sum/tl.max when triton was imported before
        the interpreter was turned on (it maps these combine functions to numpy)."""
        row = tl.program_id(0)
        base_ptr = probs_ptr + row.to(tl.int64) * probs_stride
        top_k, top_p, min_p = tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)
        offs = tl.arange(0, BLOCK)
        p_max = tl.full((), 0.0, tl.float32)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, vocab, BLOCK):
            p = tl.load(base_ptr + start + offs, mask=start + offs < vocab, other=0.0)
            p_max = tl.maximum(p_max, tl.reduce(p, 0, tl.standard._elementwise_max))
            total += tl.reduce(p, 0, tl.standard._sum_combine)
        k_on = (top_k > 0) & (top_k < vocab)
        p_on = top_p < 1.0
        k_lim = tl.where(k_on, top_k, vocab + 1).to(tl.int32)  # a token stays only with < k_lim above it
        # Search state, in float32 bit patterns: the cut lies in (lo, hi]; lo_n / lo_m are the count
        # and mass of tokens above lo (lo = -1: every token), hi_n the count above hi.
        # Phase K (in_k) finds the top_k cut only to learn S; then the cut itself is searched.
        in_k = k_on & p_on
        target = tl.where(p_on & ~k_on, top_p * total, float("inf"))
        floor = tl.where(min_p > 0.0, min_p * p_max, 0.0).to(tl.int32, bitcast=True) - 1  # min_p's own cut
        top = p_max.to(tl.int32, bitcast=True)
        lo = tl.full((), -1, tl.int32)
        lo_n = tl.full((), 0, tl.int32) + vocab
        lo_m = total
        hi = top
        hi_n = tl.full((), 0, tl.int32)
        low = tl.maximum(lo, floor)  # below min_p's cut the answer does not matter
        searching = (k_on | p_on) & (hi - low > 1)
        while searching:
            j = tl.arange(0, PIVOTS)
            piv = low + 1 + ((hi - low - 1).to(tl.int64) * j // PIVOTS).to(tl.int32)  # [P] ascending in (low, hi)
            piv_p = piv.to(tl.float32, bitcast=True)
            count = tl.full([PIVOTS], 0, tl.int32)  # tokens above each pivot
            mass = tl.full([PIVOTS], 0.0, tl.float32)  # and their mass
            next_up = tl.full([PIVOTS], float("inf"), tl.float32)  # the least p above each pivot
            next_down = tl.full([PIVOTS], 0.0, tl.float32)  # the greatest p at or below it (0: none)
            for start in range(0, vocab, BLOCK):
                p = tl.load(base_ptr + start + offs, mask=start + offs < vocab, other=0.0)
                above = p[:, None] > piv_p[None, :]  # [BLOCK, P]
                count += tl.reduce(above.to(tl.int32), 0, tl.standard._sum_combine)
                mass += tl.reduce(tl.where(above, p[:, None], 0.0), 0, tl.standard._sum_combine)
                next_up = tl.minimum(next_up, tl.reduce(tl.where(above, p[:, None], float("inf")), 0,
                                                        tl.standard._elementwise_min))
                next_down = tl.maximum(next_down, tl.reduce(tl.where(above, 0.0, p[:, None]), 0,
                                                            tl.standard._elementwise_max))
            # A pivot is at or above the cut iff the first token above it stays; monotone in the pivot.
            ok = (count == 0) | ((count < k_lim) & (mass < target))
            n_low = tl.reduce((~ok).to(tl.int32), 0, tl.standard._sum_combine)
            at_lo, at_hi = j == n_low - 1, j == n_low
            # The predicate only changes at token values, so the ends snap to the tokens next to the
            # cut: hi down to the greatest p at or below it, lo up to just below the least p above it.
            # A cut inside a group of equal values is found as soon as no other value is left.
            snap_hi = tl.reduce(tl.where(at_hi, next_down, 0.0), 0, tl.standard._sum_combine).to(tl.int32, bitcast=True)
            hi = tl.where(n_low < PIVOTS, tl.maximum(snap_hi, low + 1), hi)
            hi_n = tl.where(n_low < PIVOTS, tl.reduce(tl.where(at_hi, count, 0), 0, tl.standard._sum_combine), hi_n)
            snap_lo = tl.reduce(tl.where(at_lo, next_up, 0.0), 0, tl.standard._sum_combine)
            snap_lo = snap_lo.to(tl.int32, bitcast=True) - 1
            lo = tl.where(n_low > 0, tl.minimum(snap_lo, hi - 1), lo)
            lo_n = tl.where(n_low > 0, tl.reduce(tl.where(at_lo, count, 0), 0, tl.standard._sum_combine), lo_n)
            lo_m = tl.where(n_low > 0, tl.reduce(tl.where(at_lo, mass, 0.0), 0, tl.standard._sum_combine), lo_m)
            # Phase K is done when exactly k tokens lie above lo or (lo, hi] is one value (the k-th's,
            # ties and all): S = mass above lo less the tied tokens past position k.
            k_done = in_k & ((lo_n == k_lim) | (hi - lo <= 1))
            s_k = lo_m - (lo_n - k_lim).to(tl.float32) * (lo + 1).to(tl.float32, bitcast=True)
            target = tl.where(k_done, top_p * s_k, target)
            hi = tl.where(k_done, top, hi)
            hi_n = tl.where(k_done, 0, hi_n)
            in_k = in_k & ~k_done
            low = tl.where(in_k, lo, tl.maximum(lo, floor))
            # The cut is found when (low, hi] holds one bit pattern, or one token above a known lo.
            single = ~in_k & (lo >= floor) & (lo_n - hi_n <= 1)
            searching = (hi - low > 1) & ~single
        # Kept: p > low, i.e. p >= the next float up (bit patterns of non-negative floats are ordered).
        cut = (low + 1).to(tl.float32, bitcast=True)
        # The row's splitmix64 stream key, mix(mix(seed + golden) ^ index), in uint64 (>> logical).
        key = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
        key = (key ^ (key >> 30)) * 0xBF58476D1CE4E5B9
        key = (key ^ (key >> 27)) * 0x94D049BB133111EB
        key = key ^ (key >> 31) ^ tl.load(index_ptr + row).to(tl.uint64, bitcast=True)
        key = (key ^ (key >> 30)) * 0xBF58476D1CE4E5B9
        key = (key ^ (key >> 27)) * 0x94D049BB133111EB
        key = key ^ (key >> 31)
        best = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 0, tl.int32)
        kept_min = tl.full((), float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            p = tl.load(base_ptr + cols, mask=cols < vocab, other=0.0)
            keep = (p >= cut) & (cols < vocab)
            # Element cols + 1 of the stream; sampling.py reads its top 23 bits as a signed number
            # and adds 2**22, the same as flipping their top bit (the last xorshift cannot reach them).
            z = key + (cols.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            u = (((z >> 41) ^ 0x400000).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # exact, in (0, 1)
            if WRITE_NOISE:
                tl.store(noise_ptr + row.to(tl.int64) * vocab + cols, u, mask=cols < vocab)
            # p = 0 scores -inf either way; log(1) there spares the interpreter's numpy a warning
            score = tl.where(keep & (p > 0.0), tl.log(tl.where(p > 0.0, p, 1.0)) - tl.log(-tl.log(u)),
                             float("-inf"))
            # (score, offs), not cols: the interpreter returns the argmax's position in the block
            block_best, block_i = tl.reduce((score, offs), 0, tl.standard._argmax_combine_tie_break_left)
            better = block_best > best  # strictly: the first index wins ties, as torch.argmax
            best_i = tl.where(better, start + block_i, best_i)
            best = tl.where(better, block_best, best)
            kept_min = tl.minimum(kept_min, tl.reduce(tl.where(keep, p, float("inf")), 0, tl.standard._elementwise_min))
        tl.store(token_ptr + row, best_i.to(tl.int64))
        tl.store(kept_min_ptr + row, kept_min)

    return sample
