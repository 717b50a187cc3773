"""Batched next-token sampling, run by the worker once per step.

Contract: `SamplingBatch.build` turns per-request params into [B] tensors once per
step; `sample` maps logits [B, V] to next tokens [B] with no Python loop over rows.

Pipeline (order matters and matches the textbook definitions):
    penalties -> min_new_tokens suppression -> temperature -> top_k -> top_p -> min_p
    -> Gumbel-max over the surviving tokens.
Greedy rows (temperature 0 or top_k 1) take argmax of the penalized, suppressed
logits, so top_k=1 and temperature 0 give exactly the same token.

Randomness is counter-based: the noise for (seed, sample_index, token) is a hash,
so a request's draws depend only on its own seed and step counter, never on its
batch mates, its row position or a shared generator's state.

On a CUDA device a batch with any top_k/top_p/min_p filter is drawn by the Triton kernel
(kernels/triton/sampling.py) from the tempered softmax: the same kept sets and the same noise
without sorting the vocabulary, so a seeded request gets the CPU path's tokens up to float
rounding at a cut (see that module). Everything else, on every device, runs the torch path below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from kernels.triton import sampling as triton_sampling
from services.common.sampling_params import SamplingParams
from services.step.contract import SampledLogprobs

# splitmix64 constants as signed int64 (torch has no full uint64 arithmetic);
# int64 multiply wraps mod 2**64, which is exactly the unsigned product's bits.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
_NOISE_BITS = 23  # +0.5 then still exact in float32, so u never rounds to 0 or 1
# top_p without top_k first tries this many best tokens; a full sort only when their
# mass falls short of top_p (flat distributions).
_TOP_P_PREFIX = 1024


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift: torch's >> on int64 is arithmetic, so mask the sign fill."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """The splitmix64 finalizer: a bijection on 64-bit words."""
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def counter_uniform(seeds: Tensor, sample_indices: Tensor, token_ids: Tensor) -> Tensor:
    """Uniform noise u[b, n] in (0, 1), a pure function of (seeds[b], sample_indices[b], token id).

    seeds, sample_indices: [B] int64; token_ids: [N] (shared by all rows) or [B, N]
    int64 -> [B, N] float32. Token v of row b is element v of the splitmix64 stream
    keyed by (seed, index), so the value is the same whether the whole vocabulary
    or only a few candidate ids are hashed, and whatever the other rows are.
    """
    key = _mix64(_mix64(seeds + _GOLDEN) ^ sample_indices)[:, None]  # [B, 1], cheap
    z = torch.add(key, (token_ids + 1) * _GOLDEN)  # [B, N]
    # One reused scratch buffer: fresh [B, V] allocations cost page faults on CPU.
    # Splitmix's last xorshift(31) cannot reach the top bits we keep, so it is skipped.
    tmp = torch.empty_like(z)
    for shift, mul in ((30, _MUL1), (27, _MUL2)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        z.bitwise_xor_(tmp.bitwise_and_((1 << (64 - shift)) - 1)).mul_(mul)
    # Arithmetic shift leaves the top bits in [-2**22, 2**22); shift to [0, 2**23).
    torch.bitwise_right_shift(z, 64 - _NOISE_BITS, out=tmp)
    half = 2 ** (_NOISE_BITS - 1)
    return tmp.to(torch.float32).add_(half + 0.5).mul_(2.0 ** -_NOISE_BITS)


def _gumbel(seeds: Tensor, sample_indices: Tensor, token_ids: Tensor) -> Tensor:
    """Standard Gumbel noise -log(-log(u)), same shapes as counter_uniform."""
    return counter_uniform(seeds, sample_indices, token_ids).log_().neg_().log_().neg_()


_fused = None  # kernels/cpu/fused_ops.cpp once looked up (False: not buildable here)


def argmax_rows(x: Tensor) -> Tensor:
    """x [B, V] → [B] int64, exactly torch.argmax(x, -1) (first maximum; NaN counts as the
    maximum). On CPU float32 through the fused C++ op: torch's own takes ~3.4 ms at B=64."""
    global _fused
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        if _fused is None:
            from kernels import fused_cpu
            _fused = fused_cpu.load() or False
        if _fused:
            return _fused.argmax_rows(x.contiguous())
    return x.argmax(dim=-1)


def pad_token_lists(rows: list[list[int]], device: torch.device | str = "cpu") -> Tensor:
    """Ragged token lists -> [B, L] int64 padded with -1 (L >= 1 so shapes stay valid)."""
    width = max([len(r) for r in rows] + [1])
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows],
                        dtype=torch.int64, device=device)


@dataclass
class SamplingBatch:
    """Per-step sampling state; every tensor is [B] on the logits' device. Greedy rows
    (temperature 0 or top_k 1) get neutral filters so they never widen the candidate
    set or force a fallback; their token is the argmax regardless."""

    temperatures: Tensor  # [B] float32, 0 = greedy
    top_ks: Tensor  # [B] int64, vocab_size when disabled
    top_ps: Tensor  # [B] float32, 1.0 when disabled
    min_ps: Tensor  # [B] float32, 0.0 when disabled
    repetition_penalties: Tensor  # [B] float32, 1.0 = off
    frequency_penalties: Tensor  # [B] float32, 0.0 = off
    presence_penalties: Tensor  # [B] float32, 0.0 = off
    seeds: Tensor  # [B] int64
    sample_indices: Tensor  # [B] int64: tokens this request sampled before (noise counter)
    # min_new_tokens: (row, token) pairs set to -inf this step, flattened from the
    # ragged lists so one index_put_ covers the batch; None when nothing is suppressed.
    suppress_rows: Tensor | None  # [N] int64
    suppress_cols: Tensor | None  # [N] int64
    vocab_size: int
    # top_k/top_p thresholds come from each row's K best tokens (top_p speculating on
    # a prefix); when every sampling row filters, the noise too covers only those K.
    candidate_width: int
    all_filtered: bool
    # Flags computed once so the common path skips work.
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool
    any_freq_presence: bool

    @property
    def any_penalties(self) -> bool:
        """When False the caller need not build token histories at all."""
        return self.any_repetition or self.any_freq_presence

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], sample_indices: list[int],
              suppress_token_ids: list[list[int]], vocab_size: int,
              device: torch.device | str = "cpu") -> SamplingBatch:
        """suppress_token_ids[b]: ids row b must not emit this step (its stop/eos ids
        while min_new_tokens is not reached), [] for none. Params are assumed valid."""
        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        V = vocab_size
        greedy = [p.is_greedy for p in params]
        top_ks = [V if g or not 0 < p.top_k < V else p.top_k for g, p in zip(greedy, params)]
        top_ps = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        min_ps = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        filtered = [k < V or tp < 1.0 for k, tp in zip(top_ks, top_ps)]  # False if greedy
        # top_k + 1 candidates: the extra one shows whether a token past the cut ties with it.
        widths = [min(V, k + 1) if k < V else _TOP_P_PREFIX for k, f in zip(top_ks, filtered) if f]
        sampled = [f for f, g in zip(filtered, greedy) if not g]
        pairs = [(b, t) for b, ids in enumerate(suppress_token_ids) for t in ids]
        return cls(
            temperatures=f32([0.0 if g else p.temperature for g, p in zip(greedy, params)]),
            top_ks=i64(top_ks), top_ps=f32(top_ps), min_ps=f32(min_ps),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            presence_penalties=f32([p.presence_penalty for p in params]),
            seeds=i64(seeds), sample_indices=i64(sample_indices),
            suppress_rows=i64([b for b, _ in pairs]) if pairs else None,
            suppress_cols=i64([t for _, t in pairs]) if pairs else None,
            vocab_size=V, candidate_width=min(V, max(widths, default=V)),
            all_filtered=bool(sampled) and all(sampled),
            all_greedy=all(greedy), any_greedy=any(greedy),
            any_top_k=any(k < V for k in top_ks), any_top_p=any(tp < 1.0 for tp in top_ps),
            any_min_p=any(mp > 0.0 for mp in min_ps),
            any_repetition=any(p.repetition_penalty != 1.0 for p in params),
            any_freq_presence=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                                  for p in params),
        )


@dataclass
class SampleOutput:
    next_token_ids: Tensor  # [B] int64
    logprobs: Tensor | None  # [B] float32, raw-distribution logprob of the chosen token
    top_logprob_ids: Tensor | None  # [B, K] int64, K = max requested, sorted by value desc
    top_logprob_values: Tensor | None  # [B, K] float32


def apply_penalties(logits: Tensor, prompt_tokens: Tensor | None, output_tokens: Tensor | None,
                    repetition: Tensor, frequency: Tensor, presence: Tensor) -> Tensor:
    """Return penalized logits: a [B, V] view of a new buffer, logits untouched.

    logits [B, V]; prompt_tokens [B, P], output_tokens [B, O] int64 padded with -1
    (either may be None = empty); penalties [B]. Repetition (HF): every token seen
    in prompt or output has a positive logit divided, a negative one multiplied.
    Frequency/presence (OpenAI): over output tokens only,
    logit -= frequency * count + presence * (count > 0).
    """
    B, V = logits.shape
    # Sparse: only history positions are read and written, so the cost is one copy
    # of the logits plus O(P + O) work. Column V absorbs the -1 padding.
    out = logits.new_empty(B, V + 1)
    out[:, :V] = logits
    out[:, V] = 0.0  # defined values in the padding column, though they are dropped
    history = [t for t in (prompt_tokens, output_tokens) if t is not None and t.numel()]
    if history:
        seen = torch.cat(history, dim=1)
        seen = torch.where(seen < 0, V, seen)  # [B, P + O]
        vals = out.gather(1, seen)
        rep = repetition[:, None]
        # A token seen twice gathers the same raw logit, so duplicates write equal values.
        out.scatter_(1, seen, torch.where(vals > 0, vals / rep, vals * rep))
    if output_tokens is not None and output_tokens.numel():
        cols = torch.where(output_tokens < 0, V, output_tokens)  # [B, O]
        counts = torch.zeros_like(out).scatter_add_(1, cols, torch.ones_like(cols, dtype=out.dtype))
        penalty = frequency[:, None] * counts.gather(1, cols) + presence[:, None]
        out.scatter_(1, cols, out.gather(1, cols) - penalty)
    return out[:, :V]


def _top_p_keep(vals: Tensor, scaled: Tensor, batch: SamplingBatch) -> tuple[Tensor, bool]:
    """How many sorted candidates top_k-then-top_p keeps per row, and whether the
    candidates sufficed. vals [B, K] sorted descending, scaled [B, V] -> n_keep [B]."""
    K, V = vals.shape[1], scaled.shape[1]
    top_ks, top_ps = batch.top_ks, batch.top_ps
    within_k = torch.arange(K, device=vals.device)[None, :] < top_ks[:, None]
    restricted = vals.masked_fill(~within_k, float("-inf"))
    # top_p renormalizes over what top_k left: the candidates when top_k cut, else
    # the whole row (the candidates may be a prefix of it).
    log_norm = torch.where(top_ks < V, restricted.logsumexp(dim=-1), scaled.logsumexp(dim=-1))
    probs = (restricted - log_norm[:, None]).exp()
    cum = probs.cumsum(dim=-1)
    # Textbook top_p: the smallest prefix whose mass reaches top_p, i.e. keep
    # position j iff the mass before it is still < top_p.
    n_keep = (((cum - probs) < top_ps[:, None]) & within_k).sum(dim=-1)
    # top_p == 1 keeps everything even where float cumsum reaches 1.0 early.
    n_keep = torch.where(top_ps >= 1.0, top_ks.clamp(max=K), n_keep).clamp_(min=1)
    short = (top_ps < 1.0) & (top_ks > K) & (cum[:, -1] < top_ps)
    return n_keep, K == V or not bool(short.any())  # one host sync per step


def _candidates(scaled: Tensor, batch: SamplingBatch,
                width: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Apply top_k, then top_p, then min_p to tempered logits scaled [B, V].

    Returns (vals [B, K], ids [B, K]) with dropped tokens at -inf; ids None means
    vals is the unsorted full row (ids = arange(V)). top_k/top_p become a threshold:
    a token survives iff its logit is >= the last kept one's (ties at the cut stay),
    so every path keeps the same set whatever K the batch mates imposed.
    """
    V = scaled.shape[1]
    vals, ids = scaled, None
    if batch.any_top_k or batch.any_top_p:
        K = batch.candidate_width if width is None else width
        # A partial sort of K << V columns is far cheaper than a full sort.
        top, top_ids = scaled.topk(K, dim=-1) if K < V else scaled.sort(dim=-1, descending=True)
        n_keep = batch.top_ks.clamp(max=K)
        if batch.any_top_p:
            n_top_p, enough = _top_p_keep(top, scaled, batch)
            if not enough:  # some top_p cut lies past the prefix: redo over the whole row
                return _candidates(scaled, batch, width=V)
            n_keep = torch.minimum(n_keep, n_top_p)
        threshold = top.gather(1, (n_keep - 1)[:, None])  # [B, 1]
        unfiltered = (batch.top_ks >= V) & (batch.top_ps >= 1.0)
        threshold = threshold.masked_fill(unfiltered[:, None], float("-inf"))
        # Every kept token is among the K, so only those get noise; unless some row still keeps its
        # K-th candidate: a token past the K may tie with it, and ties at the cut stay (the whole
        # row then, as with an unfiltered mate, so the kept set never depends on the batch).
        ties_past = (top[:, -1:] >= threshold) & ~unfiltered[:, None]  # greedy rows never filter
        if batch.all_filtered and (K >= V or not bool(ties_past.any())):
            vals, ids = top, top_ids
        vals = vals.masked_fill(vals < threshold, float("-inf"))
    if batch.any_min_p:
        # p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p); renormalizing after
        # top_k/top_p scales all probs alike, so logits suffice (log(0) = -inf keeps all).
        row_max = vals.max(dim=-1, keepdim=True).values
        vals = vals.masked_fill(vals - row_max < batch.min_ps.log()[:, None], float("-inf"))
    return vals, ids


def _draw_filtered_on_device(scaled: Tensor, batch: SamplingBatch) -> Tensor:
    """What _candidates + Gumbel-max give, by the Triton kernel: scaled [B, V] tempered logits
    -> next tokens [B] int64, with no sort and no host sync. Its filters use the batch's [B]
    tensors as they are (top_k V, top_p 1, min_p 0 when off; greedy rows neutral)."""
    probs = scaled.softmax(dim=-1, dtype=torch.float32)  # [B, V]
    return triton_sampling.sample_from_probs(probs, batch.top_ks, batch.top_ps, batch.min_ps,
                                             batch.seeds, batch.sample_indices).token_ids


def sample(logits: Tensor, batch: SamplingBatch, prompt_tokens: Tensor | None = None,
           output_tokens: Tensor | None = None,
           want_logprobs: list[int] | None = None,
           apply_mask: Callable[[Tensor], None] | None = None) -> SampleOutput:
    """Pick the next token of every row. logits [B, V] float32 (left untouched).

    prompt_tokens [B, P] / output_tokens [B, O]: int64 histories padded with -1,
    read only when batch.any_penalties. want_logprobs[b]: -1 none, 0 the chosen
    token's logprob, k > 0 also the top k; when any row asks, every row gets them
    (rows slice their own k) from log_softmax of the raw logits. apply_mask: sets the tokens
    a grammar forbids to -inf in a [B, V] tensor, after the penalties and suppression.
    """
    V = logits.shape[1]
    processed = logits
    if batch.any_penalties:
        processed = apply_penalties(logits, prompt_tokens, output_tokens,
                                    batch.repetition_penalties, batch.frequency_penalties,
                                    batch.presence_penalties)
    if batch.suppress_rows is not None:
        if processed is logits:
            processed = logits.clone()
        processed.index_put_((batch.suppress_rows, batch.suppress_cols),
                             torch.tensor(float("-inf"), device=logits.device))
    if apply_mask is not None:
        if processed is logits:
            processed = logits.clone()
        apply_mask(processed)

    if batch.all_greedy:
        next_ids = argmax_rows(processed)
    else:
        greedy_rows = batch.temperatures == 0
        # Greedy rows divide by 1 here; their sampled token is replaced below.
        temps = torch.where(greedy_rows, torch.ones_like(batch.temperatures), batch.temperatures)
        scaled = processed / temps[:, None]
        if scaled.is_cuda and (batch.any_top_k or batch.any_top_p or batch.any_min_p):
            next_ids = _draw_filtered_on_device(scaled, batch)
        else:
            vals, ids = _candidates(scaled, batch)
            token_ids = ids if ids is not None else torch.arange(V, device=logits.device)
            # Gumbel-max: argmax(l/T + g) is a draw from softmax(l/T) over the kept set.
            scores = _gumbel(batch.seeds, batch.sample_indices, token_ids).add_(vals)
            pick = scores.argmax(dim=-1)  # [B]
            next_ids = pick if ids is None else ids.gather(1, pick[:, None]).squeeze(1)
        if batch.any_greedy:
            next_ids = torch.where(greedy_rows, argmax_rows(processed), next_ids)

    out = SampleOutput(next_ids, None, None, None)
    k_max = max(want_logprobs) if want_logprobs else -1
    if k_max >= 0:
        raw = logits.log_softmax(dim=-1)  # [B, V]
        out.logprobs = raw.gather(1, next_ids[:, None]).squeeze(1)
        if k_max > 0:
            top = raw.topk(k_max, dim=-1)  # sorted descending
            out.top_logprob_ids, out.top_logprob_values = top.indices, top.values
    return out


def token_logprobs(out: SampleOutput, want_logprobs: list[int]) -> list[SampledLogprobs | None]:
    """SampleOutput -> per-row SampledLogprobs for the StepResult (one host transfer each)."""
    if out.logprobs is None:
        return [None] * len(want_logprobs)
    chosen = out.logprobs.tolist()
    no_top = [[] for _ in want_logprobs]
    ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else no_top
    vals = out.top_logprob_values.tolist() if out.top_logprob_values is not None else no_top
    return [None if k < 0 else SampledLogprobs(chosen[b], list(zip(ids[b][:k], vals[b][:k])))
            for b, k in enumerate(want_logprobs)]
