"""How many tokens the router sends to each expert: per MoE layer, per logical expert.

Every sparse block (moe.py) reports its step's choices here; three counters add them:
- `total`, since the model loaded: the per-expert token counts on /metrics;
- `window`, since the expert placement last changed: EPLB's input (--enable-eplb rebalances
  from it, services/worker/parallel/expert_rebalance.py) and the imbalance gauge's;
- `recording`, between an admin start and stop (SGLang's expert distribution recorder): what a
  dump returns, and what --init-expert-location loads.

The counts stay on the model's device (a bincount and an add per layer per step, no host sync)
until someone reads them. On an expert-parallel group every rank routes the whole batch, so every
rank holds the same counts: they need no collective to agree on a rebalance.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ExpertDump:
    """A recording: tokens routed per (MoE layer, logical expert) over `forwards` forward passes."""
    layers: list[int]  # the decoder layers with experts, in row order
    logical_count: list[list[int]]  # [len(layers)][num_experts]
    forwards: int
    seconds: float
    recording: bool = False  # still recording when dumped

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def load(cls, path: str) -> "ExpertDump":
        """A dump written by /admin's dump (or to_json): what --init-expert-location reads."""
        with open(path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict) or "logical_count" not in raw:
            raise ValueError(f"--init-expert-location {path}: not an expert distribution dump "
                             "(a JSON object with logical_count [layers][experts], as /admin's dump writes)")
        counts = raw["logical_count"]
        return cls(layers=list(raw.get("layers", range(len(counts)))), logical_count=counts,
                   forwards=int(raw.get("forwards", 0)), seconds=float(raw.get("seconds", 0.0)))


@dataclass
class _Counter:
    counts: torch.Tensor  # [layers, experts] int64
    forwards: int = 0
    started: float = field(default_factory=time.monotonic)
    stopped: float | None = None

    @property
    def seconds(self) -> float:
        return (self.stopped or time.monotonic()) - self.started

    def add(self, row: int, counts: torch.Tensor) -> None:
        self.counts[row] += counts


class ExpertLoadRecorder:
    def __init__(self, layers: list[int], num_experts: int, device: torch.device | str = "cpu") -> None:
        self.layers, self.num_experts = list(layers), num_experts
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._zeros = lambda: torch.zeros(len(self.layers), num_experts, dtype=torch.int64, device=device)
        self.total = _Counter(self._zeros())
        self.window = _Counter(self._zeros())
        self.recording: _Counter | None = None
        self.recorded: _Counter | None = None  # the last stopped recording

    @classmethod
    def install(cls, model: nn.Module) -> "ExpertLoadRecorder | None":
        """A recorder fed by every sparse block of model; None for a dense model."""
        blocks = moe_blocks(model)
        if not blocks:
            return None
        recorder = cls([b.layer for b in blocks], blocks[0].num_experts, blocks[0].gate.weight.device)
        for block in blocks:
            block.recorder = recorder
        model.register_forward_pre_hook(lambda *_: recorder.count_forward())
        return recorder

    def record(self, layer: int, experts: torch.Tensor) -> None:
        """One block's choices this step: experts [T, k] logical ids."""
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)  # [E]
        row = self._row[layer]
        for counter in self._counters():
            counter.add(row, counts)

    def count_forward(self) -> None:
        for counter in self._counters():
            counter.forwards += 1

    def _counters(self) -> list[_Counter]:
        return [self.total, self.window] + ([self.recording] if self.recording is not None else [])

    def reset_window(self) -> None:
        self.window = _Counter(self._zeros())

    # --- the admin's recorder -------------------------------------------------------------

    def start(self) -> None:
        """Start a recording (a running one restarts from zero)."""
        self.recording = _Counter(self._zeros())

    def stop(self) -> None:
        if self.recording is not None:
            self.recording.stopped = time.monotonic()
            self.recorded, self.recording = self.recording, None

    def dump(self) -> ExpertDump:
        """The running recording, else the last stopped one; ValueError when there was none."""
        counter = self.recording or self.recorded
        if counter is None:
            raise ValueError("no expert distribution was recorded: start a recording first")
        return ExpertDump(self.layers, counter.counts.cpu().tolist(), counter.forwards, counter.seconds,
                          recording=self.recording is not None)


def moe_blocks(model: nn.Module) -> list:
    """The model's sparse MoE blocks (moe.SparseMoeBlock), in layer order."""
    from services.worker.model.moe import SparseMoeBlock
    return [layer.mlp for layer in getattr(model, "layers", []) if isinstance(layer.mlp, SparseMoeBlock)]
