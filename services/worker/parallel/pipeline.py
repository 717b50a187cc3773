"""Pipeline parallelism as an addition to a plain model: each stage holds a range of layers.

A stage builds the registry's own class from a config of its layers only (renumbered from 0, so
its KV pool holds just those layers) and loads those layers' tensors. Its forward is replaced:
the first stage embeds the tokens, every other stage receives the hidden state and residual
[T, hidden] from the stage before it; each runs its layers and sends them on; the last stage
computes the logits and shares them with every rank, so that every rank samples the same
tokens, as under tensor parallelism. With TP as well, each stage's TP ranks form a group of
their own, and TP rank t of stage s sends to TP rank t of stage s + 1.

Schedule: one micro-batch per step. A step's batch goes through the stages in order and each
stage waits while the others compute (a bubble of (pp - 1) / pp of each stage's time). Keeping
several micro-batches in flight needs the scheduler to plan disjoint batches ahead; that is not
built yet.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from services.worker.model.config import ModelConfig


@dataclass(frozen=True)
class PipeLink:
    """Stage `rank` of `size`: its neighbours' global ranks and who shares the logits."""
    rank: int
    size: int
    prev: int | None  # the global rank this stage receives from (None: the first stage)
    next: int | None  # the global rank it sends to (None: the last stage)
    logits_from: int  # the global rank whose logits every rank takes (the last stage's TP rank 0)

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def receive(self, tokens: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (torch.empty(tokens, hidden, dtype=dtype) for _ in range(2))  # [T, hidden] each
        dist.recv(x, self.prev)
        dist.recv(residual, self.prev)
        return x, residual

    def send(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        dist.send(x.contiguous(), self.next)
        dist.send(residual.contiguous(), self.next)

    def share_logits(self, logits: torch.Tensor | None, rows: int, vocab: int) -> torch.Tensor:
        """The last stage's float32 logits [rows, vocab], on every rank."""
        if logits is None:
            logits = torch.empty(rows, vocab, dtype=torch.float32)
        dist.broadcast(logits.contiguous(), self.logits_from)
        return logits


def pp_refusal(mc: ModelConfig, pp: int) -> str | None:
    if pp < 1:
        return f"--pp-size must be >= 1, got {pp}"
    if pp > mc.num_hidden_layers:
        return f"--pp-size {pp} exceeds the model's {mc.num_hidden_layers} layers"
    return None


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size`: layers [start, stop) of the full model, the earlier stages taking
    one more where they do not divide evenly."""
    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        why = pp_refusal(self.full, self.size)
        if why is not None:
            raise ValueError(why)

    @property
    def layers(self) -> range:
        n, extra = divmod(self.full.num_hidden_layers, self.size)
        start = self.rank * n + min(self.rank, extra)
        return range(start, start + n + (self.rank < extra))

    @property
    def config(self) -> ModelConfig:
        """The model this stage builds: its layers, renumbered from 0, each keeping its own kind
        (a sliding or full attention layer, a sparse or dense MLP)."""
        f, layers = self.full, self.layers
        fields = dict(num_hidden_layers=len(layers))
        if f.layer_types:
            fields["layer_types"] = tuple(f.layer_types[i] for i in layers)
        if f.num_experts:
            fields["mlp_only_layers"] = tuple(i - layers.start for i in layers if not f.is_moe_layer(i))
            fields["decoder_sparse_step"] = 1
        return replace(f, **fields)

    def tensors(self, full_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF name → tensor, for this stage's layers (renumbered) and every tensor outside the layers."""
        out: dict[str, torch.Tensor] = {}
        for name, t in full_tensors.items():
            layer = _layer_of(name)
            if layer is None:
                out[name] = t
            elif layer in self.layers:
                out[name.replace(f"layers.{layer}.", f"layers.{layer - self.layers.start}.", 1)] = t
        return out

    def install(self, model: nn.Module, link: PipeLink) -> None:
        """Replace the model's forward with this stage's part of it (the model's own embed, layers
        and head), sending and receiving at the stage boundaries."""
        vocab, hidden = self.full.vocab_size, self.full.hidden_size

        def forward(input_ids: torch.Tensor, meta, logits_indices: torch.Tensor) -> torch.Tensor:
            if link.first:
                x, residual = model.embed(input_ids), None  # [T, hidden]
            else:
                x, residual = link.receive(input_ids.shape[0], hidden, model.norm.weight.dtype)
            for layer in model.layers:
                x, residual = layer(x, residual, model.rope, meta, model.ops)
            logits = model.head(x, residual, logits_indices) if link.last else None
            if not link.last:
                link.send(x, residual)
            return link.share_logits(logits, logits_indices.shape[0], vocab)

        model.forward = forward


def _layer_of(name: str) -> int | None:
    """The decoder layer index in an HF tensor name (model.layers.12.mlp...), or None."""
    marker = "layers."
    at = name.find(marker)
    if at < 0:
        return None
    digits = name[at + len(marker):].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None
