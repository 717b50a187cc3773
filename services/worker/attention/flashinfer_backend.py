"""FlashInfer's paged attention as an AttentionBackend (--attention-backend flashinfer, CUDA only).

Targets flashinfer-python 0.7.4 from PyPI (the plan/run argument names below were checked
against that wheel's BatchDecodeWithPagedKVCacheWrapper and BatchPrefillWithPagedKVCacheWrapper).
Not installed by default: `create` falls back to the triton backend, with a warning, when it
cannot be imported or there is no CUDA device.

Per step, `prepare` turns the layout into two CSR plans (flashinfer_plan.py): decode items for the
decode wrapper, every other item (prefill chunks over a cached prefix, verify items) for the causal
prefill wrapper. FlashInfer's plan() schedules the work on the host and copies it to the device, so
each wrapper is planned once per step and layer variant, on the first layer that asks, then every
layer's forward only runs it. A variant (scale, window, soft-cap: Gemma 2 alternates windowed and
global layers) is fixed at plan time in FlashInfer, so each variant has its own pair of wrappers;
all of them share one float workspace, allocated once (they run one after another on one stream).
No CUDA graphs: attach declines a worker that captures them (--disable-cuda-graph).

The pool's layer [S, Hkv, D] viewed as [pages, page_size, Hkv, D] is FlashInfer's "NHD" layout with
K and V as two tensors, read in place. Our window W (keys p - W + 1 .. p) is FlashInfer's
window_left = W - 1 (inclusive); its soft-cap is ours (cap * tanh(scale * q.k / cap)).

FP8 pools (--kv-cache-dtype): FlashInfer reads the one-byte rows itself (k_scale multiplies the
scores). Our rows are stored Hadamard-rotated (kernels/kv_fp8.py), so the query is rotated before
the kernel and the output after, as the torch backend does; the V scale is folded into that output
rotation instead of FlashInfer's separate multiply.

The plan arithmetic needs the step's lengths and page rows on the host, where the runner builds
them. A layout that arrives with them on the device costs one device-to-host copy per step here,
which waits for the work already queued on the stream (the previous step, when steps overlap).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from kernels.kv_fp8 import hadamard_rotate
from services.worker.attention.backend import Attached, AttentionBackend, DecodeStep, create_backend
from services.worker.attention.batch_layout import BatchLayout
from services.worker.attention.flashinfer_plan import PagedPlan, step_plans
from services.worker.kv_pool import KVPool
from services.worker.model.layer_attention import LayerAttention

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20  # FlashInfer's split-KV partial results; its docs suggest 128 MiB
Q_DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer has no float32 kernels
TENSOR_CORE_GROUP = 4  # decode on tensor cores from this many query heads per KV head


def create(scale: float, sliding_window: int | None = None) -> AttentionBackend:
    """The registry's factory for "flashinfer": this backend, or the triton backend with a
    logged warning when FlashInfer cannot run here (`unavailable` says why)."""
    reason = unavailable()
    if reason is None:
        return FlashInferBackend(scale, sliding_window)
    log.warning("attention backend flashinfer unavailable (%s): using triton instead", reason)
    return create_backend("triton", scale=scale, sliding_window=sliding_window)


def unavailable() -> str | None:
    """Why FlashInfer cannot run in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # not installed, or a build that cannot load (its CUDA libraries)
        return f"cannot import flashinfer ({type(e).__name__}: {e})"
    return None


class FlashInferBackend:
    """flashinfer: the module to run (tests pass a torch stand-in that runs on CPU tensors);
    None imports the real one, which needs the pool on a CUDA device.
    sliding_window W: a query at position p attends to keys p - W + 1 .. p (Mistral)."""

    def __init__(self, scale: float, sliding_window: int | None = None, flashinfer: Any = None,
                 workspace_bytes: int = WORKSPACE_BYTES):
        if flashinfer is None:
            import flashinfer
            self._needs_cuda = True
        else:
            self._needs_cuda = False
        self.fi = flashinfer
        self.default = LayerAttention(scale, sliding_window)  # the layers that pass no variant of their own
        self.workspace_bytes = workspace_bytes
        self.workspace: torch.Tensor | None = None  # [workspace_bytes] uint8, allocated on the first step
        self.wrappers: dict[tuple[str, LayerAttention], Any] = {}  # kept across steps, planned per step
        self.pool: KVPool | None = None
        self.layout: BatchLayout | None = None
        self.plans: dict[str, PagedPlan] = {}  # "decode" / "extend" → this step's plan
        self.q_index: dict[str, torch.Tensor] = {}  # kind → its plan's q_index on the pool's device
        self.planned: set[tuple[str, LayerAttention]] = set()  # wrappers planned for this step

    def attach(self, model, config, checkpoint, prepacked: bool) -> Attached:
        if config.torch_dtype not in Q_DTYPES:
            raise ValueError(f"--attention-backend flashinfer computes in bfloat16 or float16, not "
                             f"{config.torch_dtype}: pass --dtype bfloat16 (or use --attention-backend triton)")
        if getattr(config, "uses_cuda_graphs", False):
            # FlashInfer's graph mode re-plans on the host before every replay; the captured decode
            # steps (services/worker/cuda_graphs.py) prepare from device buffers only, with no such hook.
            raise ValueError("--attention-backend flashinfer has no CUDA-graph decode path: pass "
                             "--disable-cuda-graph, or use --attention-backend triton")
        return Attached()

    def one_call_step(self, step: DecodeStep, before_compute: Callable[[], None]) -> torch.Tensor | None:
        return None  # every step op by op

    def prepare(self, layout: BatchLayout, pool: KVPool) -> None:
        """Plan the step on the host (no wrapper is planned yet: that needs the query's heads
        and dtype, which the first forward brings). ValueError for a pool FlashInfer cannot read."""
        device = pool.k.device
        if self._needs_cuda and device.type != "cuda":
            raise ValueError(f"--attention-backend flashinfer needs the KV pool on CUDA, it is on {device}")
        if pool.spec.dtype not in Q_DTYPES and not pool.spec.is_fp8:
            raise ValueError(f"FlashInfer reads bfloat16, float16 or FP8 KV, not {pool.spec.dtype}")
        if self.workspace is None:
            self.workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        self.pool, self.layout = pool, layout
        self.plans = step_plans(_on_host(layout))
        self.q_index = {kind: plan.q_index.to(device, non_blocking=True)
                        for kind, plan in self.plans.items() if not plan.whole_step}
        self.planned.clear()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                variant: LayerAttention | None = None) -> torch.Tensor:
        # q [T, H, D]; k, v [T, Hkv, D] → [T, H, D] in q's dtype
        spec = variant or self.default
        pool = self.pool
        pool.write(layer, self.layout.out_slots, k, v)
        page = (-1, pool.spec.page_size, *pool.k.shape[2:])  # [pages (any extra ones too), page_size, Hkv, D]
        paged = pool.k[layer].view(page), pool.v[layer].view(page)
        k_scale = pool.spec.kv_scale if pool.spec.is_fp8 else None
        q = self._rotated(q, 1.0)
        out = None
        for kind, plan in self.plans.items():
            wrapper = self._planned(kind, spec, q)
            if plan.whole_step:  # all T tokens, in order: the output is already in place
                out = wrapper.run(q.contiguous(), paged, k_scale=k_scale)
                continue
            rows = self.q_index[kind]
            o = wrapper.run(q.index_select(0, rows), paged, k_scale=k_scale)  # [n, H, D]
            if out is None:
                out = torch.empty_like(q)
            out.index_copy_(0, rows, o)
        return self._rotated(out, pool.spec.kv_scale)

    def _planned(self, kind: str, spec: LayerAttention, q: torch.Tensor) -> Any:
        """The wrapper of (kind, spec), planned for this step (on its first layer of the step)."""
        key = (kind, spec)
        wrapper = self.wrappers.get(key)
        if wrapper is None:
            wrapper = self._new_wrapper(kind, q.shape[1] // self.pool.spec.num_kv_heads)
            self.wrappers[key] = wrapper
        if key not in self.planned:
            self._plan(wrapper, kind, spec, q)
            self.planned.add(key)
        return wrapper

    def _new_wrapper(self, kind: str, group: int) -> Any:
        if kind == "decode":
            return self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=group >= TENSOR_CORE_GROUP)
        return self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def _plan(self, wrapper: Any, kind: str, spec: LayerAttention, q: torch.Tensor) -> None:
        if q.dtype not in Q_DTYPES:
            raise ValueError(f"FlashInfer attends bfloat16 or float16 queries, not {q.dtype}")
        plan, s = self.plans[kind], self.pool.spec
        options = dict(
            sm_scale=spec.scale,
            window_left=-1 if spec.window is None else spec.window - 1,
            logits_soft_cap=spec.softcap,
            q_data_type=q.dtype, kv_data_type=s.dtype, o_data_type=q.dtype)
        shape = (q.shape[1], s.num_kv_heads, s.head_dim, s.page_size)  # heads, KV heads, head dim, page size
        if kind == "decode":
            wrapper.plan(plan.kv_indptr, plan.kv_indices, plan.last_page_len, *shape, **options)
        else:
            wrapper.plan(plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.last_page_len, *shape,
                         causal=True, **options)

    def _rotated(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x [..., D] into (or, H being its own inverse, out of) an FP8 pool's rotated space,
        times scale, in x's dtype; x itself for any other pool."""
        if not self.pool.spec.is_fp8:
            return x
        y = hadamard_rotate(x.float())
        return (y if scale == 1.0 else y.mul_(scale)).to(x.dtype)


def _on_host(layout: BatchLayout) -> BatchLayout:
    """The layout with the tensors planning reads on the host (itself when they are there)."""
    if layout.q_lens.device.type == "cpu" and layout.page_rows.device.type == "cpu":
        return layout
    if layout.host is not None:  # the runner's: built on the host, copied to the device (no sync)
        return layout.host
    q_lens, kv_lens = torch.stack((layout.q_lens, layout.kv_lens)).cpu()  # waits for queued work
    return dataclasses.replace(layout, q_lens=q_lens, kv_lens=kv_lens, page_rows=layout.page_rows.cpu())
