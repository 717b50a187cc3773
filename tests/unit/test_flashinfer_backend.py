"""The FlashInfer attention backend (services/worker/attention/flashinfer_backend.py) on CPU.

FlashInfer itself needs CUDA, so here:
- the plan arithmetic (flashinfer_plan.py) is decoded back into KV slots and compared exactly with
  BatchLayout and the torch backend's gather (page sizes 1/16/64, ragged mixed batches);
- the backend runs against a torch stand-in for the flashinfer module that implements the
  wrappers' documented contract (CSR pages, causal alignment, window_left, soft-cap, k/v scales),
  and its outputs are compared with TorchAttentionBackend's (bfloat16 and FP8 pools, windows,
  soft-caps, mixed and pure-decode steps);
- the fallback to triton when flashinfer cannot run.
With flashinfer importable (PYTHONPATH=an unpacked wheel), the stand-in's recorded calls are bound
to the real wrappers' signatures; with CUDA too, the gpu test runs the real wrappers."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import sys
import types

import pytest
import torch

from services.worker.attention import backend as registry
from services.worker.attention import flashinfer_backend
from services.worker.attention.backend import create_backend
from services.worker.attention.batch_layout import BatchLayout, slots_of
from services.worker.attention.flashinfer_backend import FlashInferBackend
from services.worker.attention.flashinfer_plan import paged_plan, split_items, step_plans
from services.worker.attention.torch_backend import TorchAttentionBackend, _build_group
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.model.layer_attention import LayerAttention

MIXED = [(0, 7), (23, 1), (40, 9), (64, 1), (0, 1), (5, 12), (31, 1), (16, 16)]  # (start_pos, q_len)
DECODE = [(23, 1), (63, 1), (1, 1), (100, 1)]


def make_layout(items: list[tuple[int, int]], page_size: int, num_pages: int, seed: int) -> BatchLayout:
    """Each item's pages drawn from a shuffled pool; page-table padding is -1, which no plan may read."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(s + q) // page_size) for s, q in items]
    order = torch.randperm(num_pages, generator=g)
    rows = torch.full((len(items), max(need) + 1), -1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(need):
        rows[i, :n] = order[used:used + n]
        used += n
    return BatchLayout.build([q for _, q in items], [s for s, _ in items], rows, page_size)


def plan_slots(plan, page_size: int) -> list[torch.Tensor]:
    """What a FlashInfer kernel reads: each item's KV slots, position 0 .. kv_len - 1, decoded
    from the CSR arrays alone."""
    out = []
    for i in range(plan.batch_size):
        pages = plan.kv_indices[plan.kv_indptr[i]:plan.kv_indptr[i + 1]].long()
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
        out.append(slots[:(len(pages) - 1) * page_size + int(plan.last_page_len[i])])
    return out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("items", [MIXED, DECODE, [(0, 13), (64, 64), (17, 3)]], ids=["mixed", "decode", "extend"])
def test_plans_recover_every_slot(page_size, items):
    """Every token's KV slot, decoded from the plans, is BatchLayout's (out_slots for this step's
    tokens) and the torch backend's gather; queries partition the step's tokens in order."""
    layout = make_layout(items, page_size, num_pages=600 // page_size + 8, seed=page_size)
    plans = step_plans(layout)
    covered = torch.cat([p.q_index for p in plans.values()]).sort().values
    assert torch.equal(covered, torch.arange(layout.positions.numel()))
    for kind, plan in plans.items():
        assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len))
        assert torch.equal(plan.q_index, plan.q_index.sort().values)
        assert ((plan.last_page_len >= 1) & (plan.last_page_len <= page_size)).all()
        assert torch.equal(plan.qo_indptr.diff().long(), layout.q_lens[plan.items])
        assert bool((layout.q_lens[plan.items] == 1).all()) == (kind == "decode")
        assert plan.whole_step == (len(plans) == 1)
        gather = _build_group(layout, plan.items).kv_slots
        for i, (item, slots) in enumerate(zip(plan.items.tolist(), plan_slots(plan, page_size))):
            kv, q = int(layout.kv_lens[item]), int(layout.q_lens[item])
            assert torch.equal(slots, slots_of(layout.page_rows, torch.tensor(item), torch.arange(kv), page_size))
            assert torch.equal(slots, gather[i, :kv])
            rows = plan.q_index[plan.qo_indptr[i]:plan.qo_indptr[i + 1]]
            assert torch.equal(slots[kv - q:], layout.out_slots[rows])  # causal alignment: the last q_len


def test_split_and_refusals():
    decode, extend = split_items(torch.tensor([1, 4, 1, 2]))
    assert decode.tolist() == [0, 2] and extend.tolist() == [1, 3]
    rows = torch.arange(8).view(2, 4)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        paged_plan(torch.tensor([3, 1]), torch.tensor([2, 5]), rows, 2, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="pages"):
        paged_plan(torch.tensor([1, 1]), torch.tensor([2, 9]), rows, 2, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="at least one"):
        paged_plan(torch.tensor([1]), torch.tensor([1]), rows, 2, torch.tensor([], dtype=torch.int64))


class _Wrapper:
    """A torch stand-in for FlashInfer's paged wrappers, keyword for keyword: what it does is
    their documented contract, written independently of the backend."""

    calls: list = []  # (class name, method, args, kwargs), for the signature check

    def __init__(self, float_workspace_buffer, kv_layout="NHD", **kwargs):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.calls.append((self.NAME, "__init__", (float_workspace_buffer, kv_layout), kwargs))

    def _set_plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                  page_size, *, sm_scale, window_left=-1, logits_soft_cap=None, q_data_type, kv_data_type,
                  o_data_type, causal):
        assert all(t.dtype == torch.int32 for t in (qo_indptr, indptr, indices, last_page_len))
        self.p = dict(qo=qo_indptr.long(), indptr=indptr.long(), indices=indices.long(), last=last_page_len.long(),
                      heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size, scale=sm_scale,
                      window=window_left, cap=logits_soft_cap, dtypes=(q_data_type, kv_data_type, o_data_type),
                      causal=causal)

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None):
        self.calls.append((self.NAME, "run", (q, paged_kv_cache), dict(k_scale=k_scale, v_scale=v_scale)))
        p = self.p
        kc, vc = paged_kv_cache
        H, Hkv, D = p["heads"]
        assert q.is_contiguous() and q.shape[1:] == (H, D) and q.shape[0] == int(p["qo"][-1])
        assert (q.dtype, kc.dtype, p["dtypes"][2]) == (p["dtypes"][0], p["dtypes"][1], q.dtype)
        out = torch.empty(q.shape, dtype=p["dtypes"][2])
        for i in range(len(p["last"])):
            pages = p["indices"][p["indptr"][i]:p["indptr"][i + 1]]
            kv = (len(pages) - 1) * p["page_size"] + int(p["last"][i])
            k = kc[pages].flatten(0, 1)[:kv].float().repeat_interleave(H // Hkv, 1)  # [kv, H, D]
            v = vc[pages].flatten(0, 1)[:kv].float().repeat_interleave(H // Hkv, 1)
            qi = q[p["qo"][i]:p["qo"][i + 1]].float()  # [n, H, D]
            s = torch.einsum("nhd,khd->hnk", qi, k) * p["scale"] * (k_scale or 1.0)
            if p["cap"]:
                s = p["cap"] * torch.tanh(s / p["cap"])
            pos = kv - qi.shape[0] + torch.arange(qi.shape[0])  # queries end-aligned with the KV
            key = torch.arange(kv)
            ok = key[None] <= pos[:, None] if p["causal"] else torch.ones(len(pos), kv, dtype=torch.bool)
            if p["window"] >= 0:
                ok &= key[None] >= pos[:, None] - p["window"]
            w = torch.softmax(s.masked_fill(~ok, -math.inf), -1)
            out[p["qo"][i]:p["qo"][i + 1]] = (torch.einsum("hnk,khd->nhd", w, v) * (v_scale or 1.0)).to(out.dtype)
        return out


class _Decode(_Wrapper):
    NAME = "BatchDecodeWithPagedKVCacheWrapper"

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw):
        self.calls.append((self.NAME, "plan", (indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                                               head_dim, page_size), kw))
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._set_plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                       causal=True, **kw)


class _Prefill(_Wrapper):
    NAME = "BatchPrefillWithPagedKVCacheWrapper"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, **kw):
        self.calls.append((self.NAME, "plan", (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                               num_qo_heads, num_kv_heads, head_dim_qk, page_size), kw))
        self._set_plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                       num_kv_heads, head_dim_qk, page_size, **kw)


STAND_IN = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_Decode,
                                 BatchPrefillWithPagedKVCacheWrapper=_Prefill)
VARIANTS = {"plain": None, "window": LayerAttention(0.125, window=5), "softcap": LayerAttention(0.2, softcap=3.0)}


def run_both(fi, items, page_size, kv_dtype, variant, device="cpu", H=6, Hkv=2, D=64, steps=2):
    """The same steps (items, then each item decoding once more per later step) through
    FlashInferBackend (module `fi`, on `device`) and TorchAttentionBackend (CPU), each over
    its own pool holding the same earlier KV → [(flashinfer output, torch output)] per step."""
    g = torch.Generator().manual_seed(page_size + len(items))
    spec = KVPoolSpec(800 // page_size + 8, page_size, 2, Hkv, D, kv_dtype)
    pools = KVPool(spec, device), KVPool(spec)
    backends = FlashInferBackend(0.125, flashinfer=fi), TorchAttentionBackend(0.125)
    layout = make_layout([(s, q + steps) for s, q in items], page_size, spec.num_pages, seed=page_size)
    rows = layout.page_rows
    history = BatchLayout.build([s for s, _ in items if s], [0 for s, _ in items if s],
                                rows[[i for i, (s, _) in enumerate(items) if s]], page_size)
    hk, hv = torch.randn(2, history.positions.numel(), Hkv, D, generator=g).bfloat16() * 2
    for pool in pools:
        for layer in range(2):
            pool.write(layer, history.out_slots.to(pool.k.device), hk.to(pool.k.device), hv.to(pool.k.device))
    results, starts, q_lens = [], [s for s, _ in items], [q for _, q in items]
    for _ in range(steps):
        layout = BatchLayout.build(q_lens, starts, rows, page_size)
        T = sum(q_lens)
        q = torch.randn(T, H, D, generator=g).bfloat16()
        k, v = (torch.randn(2, T, Hkv, D, generator=g) * 2).bfloat16()
        outs = []
        for backend, pool in zip(backends, pools):
            on = pool.k.device
            backend.prepare(_layout_to(layout, on), pool)
            outs.append([backend.forward(layer, q.to(on), k.to(on), v.to(on), variant).cpu() for layer in range(2)])
        results.append(outs)
        starts, q_lens = [s + n for s, n in zip(starts, q_lens)], [1] * len(items)
    assert torch.equal(pools[0].k.cpu().view(torch.uint8), pools[1].k.view(torch.uint8))  # both wrote the same rows
    return results


def _layout_to(layout: BatchLayout, device) -> BatchLayout:
    return dataclasses.replace(layout, **{f.name: getattr(layout, f.name).to(device)
                                          for f in dataclasses.fields(layout)
                                          if isinstance(getattr(layout, f.name), torch.Tensor)})


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_the_torch_backend(page_size, variant, kv_dtype):
    """A mixed step then a pure-decode step, two layers: the backend's writes, rotations, plans
    and scatter, with the stand-in's attention, equal the torch backend's outputs."""
    _Wrapper.calls.clear()
    for fi_out, torch_out in run_both(STAND_IN, MIXED, page_size, kv_dtype, VARIANTS[variant]):
        for a, b in zip(fi_out, torch_out):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
    plans = [kw for name, method, _, kw in _Wrapper.calls if method == "plan"]
    spec = VARIANTS[variant] or LayerAttention(0.125)
    assert len(plans) == 3  # decode + extend in the mixed step, decode in the next: once per step, not per layer
    assert all(kw["window_left"] == (spec.window - 1 if spec.window else -1) and kw["sm_scale"] == spec.scale
               and kw["logits_soft_cap"] == spec.softcap and kw["kv_data_type"] == kv_dtype for kw in plans)
    runs = [kw for name, method, _, kw in _Wrapper.calls if method == "run"]
    assert len(runs) == 6 and all(kw["k_scale"] == (0.25 if kv_dtype != torch.bfloat16 else None) for kw in runs)


def test_a_variant_per_layer_plans_its_own_wrappers():
    """Gemma 2's alternation: windowed and global layers in one step plan two wrapper pairs, each once."""
    _Wrapper.calls.clear()
    backend = FlashInferBackend(0.125, flashinfer=STAND_IN)
    pool = KVPool(KVPoolSpec(64, 16, 4, 2, 64, torch.bfloat16))
    layout = make_layout(MIXED, 16, 64, seed=3)
    backend.prepare(layout, pool)
    T = layout.positions.numel()
    for layer in range(4):
        variant = LayerAttention(0.1, window=4 if layer % 2 else None, softcap=50.0)
        backend.forward(layer, torch.randn(T, 6, 64).bfloat16(), *torch.randn(2, T, 2, 64).bfloat16(), variant)
    inits = [c for c in _Wrapper.calls if c[1] == "__init__"]
    plans = [c for c in _Wrapper.calls if c[1] == "plan"]
    assert len(inits) == len(plans) == 4 and len(backend.wrappers) == 4


def test_declines_what_flashinfer_cannot_compute():
    backend = FlashInferBackend(0.125, flashinfer=STAND_IN)
    with pytest.raises(ValueError, match="bfloat16"):
        backend.attach(None, types.SimpleNamespace(torch_dtype=torch.float32), None, False)
    with pytest.raises(ValueError, match="disable-cuda-graph"):
        backend.attach(None, types.SimpleNamespace(torch_dtype=torch.bfloat16, uses_cuda_graphs=True), None, False)
    eager = types.SimpleNamespace(torch_dtype=torch.bfloat16, uses_cuda_graphs=False)
    assert backend.attach(None, eager, None, False).one_call_rows == 0
    with pytest.raises(ValueError, match="float32"):
        backend.prepare(make_layout(DECODE, 16, 32, 0), KVPool(KVPoolSpec(32, 16, 1, 2, 64, torch.float32)))
    pool = KVPool(KVPoolSpec(32, 16, 1, 2, 64, torch.bfloat16))
    backend.prepare(make_layout(DECODE, 16, 32, 0), pool)
    with pytest.raises(ValueError, match="queries"):
        backend.forward(0, torch.randn(4, 6, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64))


class StubTriton:
    def __init__(self, scale, sliding_window=None):
        self.scale, self.sliding_window = scale, sliding_window


@pytest.mark.parametrize("cuda", [False, True])
def test_falls_back_to_triton_when_flashinfer_cannot_run(monkeypatch, caplog, cuda):
    """No CUDA device, or CUDA without an importable flashinfer: the registry's "flashinfer"
    gives the "triton" backend, and says why in a warning."""
    monkeypatch.setitem(registry._BACKENDS, "triton", (f"{__name__}:StubTriton", {}))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer → ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with caplog.at_level(logging.WARNING, logger=flashinfer_backend.__name__):
        backend = create_backend("flashinfer", scale=0.5, sliding_window=7)
    assert type(backend) is StubTriton and (backend.scale, backend.sliding_window) == (0.5, 7)
    why = "cannot import flashinfer" if cuda else "no CUDA device"
    assert any(why in r.getMessage() and "triton" in r.getMessage() for r in caplog.records)


def test_falls_back_to_the_real_triton_backend():
    if "triton" not in registry._BACKENDS or flashinfer_backend.unavailable() is None:
        pytest.skip("no triton backend registered yet, or flashinfer runs here")
    backend = create_backend("flashinfer", scale=0.5)
    assert type(backend).__name__ == "TritonAttentionBackend"


def test_calls_bind_to_the_real_flashinfer():
    """Every call the backend made to the stand-in binds to the installed flashinfer's signatures
    (the decode plan's options are checked against the keyword-only _plan_impl it forwards to)."""
    import flashinfer as real  # a test extra: the binding check always runs
    _Wrapper.calls.clear()
    run_both(STAND_IN, MIXED, 16, torch.float8_e4m3fn, LayerAttention(0.1, window=5, softcap=30.0), steps=1)
    for name, method, args, kwargs in _Wrapper.calls:
        cls = getattr(real, name)
        fn = cls._plan_impl if (name, method) == ("BatchDecodeWithPagedKVCacheWrapper", "plan") else getattr(cls, method)
        inspect.signature(fn).bind(None, *args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(8, 2), (6, 2)], ids=["gqa4-tensor-cores", "gqa3"])
def test_real_wrappers_match_the_torch_backend_on_cuda(page_size, kv_dtype, heads):
    import flashinfer as real
    variants = [None, LayerAttention(0.125, window=5)] + ([LayerAttention(0.2, softcap=3.0)] if page_size == 16 else [])
    for variant in variants:
        for fi_out, torch_out in run_both(real, MIXED, page_size, kv_dtype, variant, "cuda", *heads, D=128):
            for a, b in zip(fi_out, torch_out):
                torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)
