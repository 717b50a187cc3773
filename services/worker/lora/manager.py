"""The worker's LoRA adapters: loaded ones on the host, up to max_loras resident in slots.

`load` reads and checks an adapter (host memory only); a step's `batch` makes the adapters its
requests use resident, loading a missing one into a free slot or the least recently used slot
no request of this step uses, and groups the step's rows by slot; `active(batch)` applies it
for the duration of the forward. Hooks sit on the model's linears only while some adapter is
loaded. A step that uses more distinct adapters than slots is the scheduler's error
(it keeps each step within max_loras): RuntimeError.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from services.worker.lora import backend_select
from services.worker.lora.adapter import AdapterError, LoraAdapter, check_name, load_adapter
from services.worker.lora.batch import LoraBatch, LoraContext, group_rows
from services.worker.lora.stacked import StackedLora
from services.worker.lora.targets import Target, TargetKey, model_targets
from services.worker.model.linear import Linear


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    identity: str  # name@digest: the KV-cache namespace of its requests
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    path: str
    resident: bool  # in a slot now (else on the host only)


class LoraManager:
    """in_use(name): whether a live request runs under that adapter (unload is refused then)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int,
                 in_use: Callable[[str], bool] = lambda name: False, shard_pair=None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be >= 1, got {max_loras} and {max_rank}")
        self.max_loras, self.max_rank, self._in_use = max_loras, max_rank, in_use
        self._shard_pair = shard_pair  # a tensor-parallel rank's slice of each adapter (adapter.load_adapter)
        # Adapters run on the fused kernel where one serves the device (backend_select: C++ on CPU,
        # Triton SGMV on CUDA), else on stacked.py's torch paths; set_fused_kernel(False) holds them to the torch paths.
        self._fused_on = True
        weight = model.norm.weight  # always dense (the embedding may be held only quantized: --quantization)
        self.device = weight.device
        # The adapters' math runs in the model's dtype; in half precision on a CPU the slots'
        # matrices are prepacked for oneDNN (stacked.py), as the model's linears are.
        self.dtype = weight.dtype
        self.targets: dict[TargetKey, Target] = model_targets(model)
        # Each target linear once, with its modules: linear → [(key, target)].
        self._linears: dict[Linear, list[tuple[TargetKey, Target]]] = {}
        for key, target in self.targets.items():
            self._linears.setdefault(target.linear, []).append((key, target))
        self.context = LoraContext()
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots: list[str | None] = [None] * max_loras  # slot → resident adapter
        self._last_used = [0] * max_loras  # slot → the step that last used it
        self._clock = 0
        self._stacks: dict[Linear, StackedLora] = {}
        self._lock = threading.Lock()  # load/unload may come from the service's thread

    # --- the registry ------------------------------------------------------------
    def load(self, name: str, path: str) -> AdapterInfo:
        """Read and check the PEFT adapter at `path` under `name` → its info. Loading the same
        name again is a no-op when the files are the same, refused (AdapterError) otherwise."""
        adapter = load_adapter(name, path, self.targets, self.max_rank, self.dtype, self._shard_pair)
        with self._lock:
            old = self.adapters.get(name)
            if old is not None and old.identity != adapter.identity:
                raise AdapterError(f"adapter {name!r} is loaded already ({old.identity} from {old.path}); "
                                   "unload it first")
            if old is None:
                self.adapters[name] = adapter
                if not self._stacks:
                    self._install_hooks()
            return self._info(name)

    def unload(self, name: str) -> None:
        """Forget adapter `name`; refused (AdapterError) while a live request runs under it."""
        with self._lock:
            if name not in self.adapters:
                raise AdapterError(f"no adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
            if self._in_use(name):
                raise AdapterError(f"adapter {name!r} is in use by a running request; unload it once they finish")
            del self.adapters[name]
            if name in self.slots:
                slot = self.slots.index(name)
                self.slots[slot] = None
                for stack in self._stacks.values():
                    stack.clear(slot)
            if not self.adapters:
                self._remove_hooks()

    def infos(self) -> list[AdapterInfo]:
        """Every loaded adapter, by name."""
        with self._lock:
            return [self._info(name) for name in sorted(self.adapters)]

    def identity(self, name: str) -> str:
        """The identity of loaded adapter `name` ("" for the base model)."""
        return self.adapters[name].identity if name else ""

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def _info(self, name: str) -> AdapterInfo:
        a = self.adapters[name]
        return AdapterInfo(a.name, a.identity, a.rank, a.scaling, a.target_modules, a.path, name in self.slots)

    # --- hooks on the model ----------------------------------------------------------
    def _install_hooks(self) -> None:
        kernel = backend_select.fused_kernel(self.device)
        for linear in self._linears:
            stack = StackedLora(linear.in_features, linear.out_features, self.max_loras, self.dtype, self.device,
                                self.context, kernel)
            stack.use_fused = self._fused_on
            self._stacks[linear] = linear.lora = stack

    def set_fused_kernel(self, on: bool) -> None:
        """Apply the adapters with the fused kernel (where it built) or on the torch paths only,
        from the next step on (bench/lora.py compares the two in one run)."""
        self._fused_on = on
        for stack in self._stacks.values():
            stack.use_fused = on

    def _remove_hooks(self) -> None:
        """With no adapter loaded the linears run exactly their base code, and the stacks are freed."""
        for linear in self._stacks:
            linear.lora = None
        self._stacks.clear()
        self.slots = [None] * self.max_loras

    # --- the step -----------------------------------------------------------------
    def batch(self, adapters: list[tuple[str, int]]) -> LoraBatch | None:
        """adapters: per item in the step's flat order, (its adapter name, "" for the base model;
        its token count) → the step's rows by slot, the adapters made resident; None when no item
        has an adapter. Raises RuntimeError for more distinct adapters than slots, AdapterError
        for a name not loaded."""
        names = list(dict.fromkeys(name for name, _ in adapters if name))
        if not names:
            return None
        with self._lock:
            slot_of = self._make_resident(names)
        return group_rows([(slot_of[name] if name else -1, n) for name, n in adapters], self.device)

    @contextlib.contextmanager
    def active(self, batch: LoraBatch | None) -> Iterator[None]:
        """Apply `batch` in the model's linears inside the block (None: nothing to apply)."""
        if batch is None:
            yield
            return
        self.context.batch = batch
        try:
            yield
        finally:
            self.context.batch = None

    def _make_resident(self, names: list[str]) -> dict[str, int]:
        """Put every adapter of `names` (distinct) in a slot → name → slot."""
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step uses {len(names)} distinct LoRA adapters, more than the worker's "
                               f"--max-loras {self.max_loras} (the scheduler must keep steps within it)")
        unknown = [n for n in names if n not in self.adapters]
        if unknown:
            raise AdapterError(f"adapters {unknown} are not loaded (loaded: {sorted(self.adapters)})")
        self._clock += 1
        for name in names:  # first mark this step's residents, so none of them is evicted below
            if name in self.slots:
                self._last_used[self.slots.index(name)] = self._clock
        slot_of = {}
        for name in names:
            if name not in self.slots:
                self._place(name, self._free_slot())
            slot = slot_of[name] = self.slots.index(name)
            self._last_used[slot] = self._clock
        return slot_of

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one not used by the current step."""
        if None in self.slots:
            return self.slots.index(None)
        return min((s for s in range(self.max_loras) if self._last_used[s] < self._clock),
                   key=self._last_used.__getitem__)

    def _place(self, name: str, slot: int) -> None:
        """Copy adapter `name`'s weights into `slot` of every hooked linear (evicting what it held)."""
        weights = self.adapters[name].weights
        for linear, modules in self._linears.items():
            segments = [(t.lo, t.hi, *weights[key]) for key, t in modules if key in weights]
            stack = self._stacks[linear]
            if segments:
                stack.write(slot, [(lo, hi, a.to(self.device), b.to(self.device)) for lo, hi, a, b in segments])
            else:
                stack.clear(slot)
        self.slots[slot] = name
