"""Pipeline parallelism as an addition to a plain model: each stage holds a range of layers.

A stage builds the registry's own class from a config of its layers only (renumbered from 0, so
its KV pool holds just those layers) and loads those layers' tensors. Its forward is replaced:
the first stage embeds the tokens, every other stage receives the hidden state and residual
[T, hidden] from the stage before it; each runs its layers and sends them on; the last stage
computes the logits and shares them with every rank, so that every rank samples the same
tokens, as under tensor parallelism. With TP as well, each stage's TP ranks form a group of
their own, and TP rank t of stage s sends to TP rank t of stage s + 1.

Schedule: a GPipe-style forward fill within each step. The runner splits a step's batch by
request into K contiguous micro-batches (`--pp-micro-batches`, default the number of stages;
fewer when the step has fewer requests, or fewer than K × `--pp-micro-batch-tokens` tokens), each
with its own attention metadata. Every stage runs them
in order: it receives micro-batch i (the first stage embeds it), runs its layers and sends it on
without waiting (dist.isend), then goes on to i + 1 while the next stage computes i; the last
stage keeps each micro-batch's logits. Once every micro-batch is through, each rank waits for its
sends and the last stage broadcasts the logits of all K in one collective, so that no rank waits
on a broadcast while a later micro-batch is still in its sends. Each stage idles (pp - 1) /
(K + pp - 1) of a step (the fill and drain), against (pp - 1) / pp with one micro-batch. Micro-
batches are independent: a request's KV writes and attention stay inside its own micro-batch.
Steps do not overlap each other (the next step's batch depends on this one's tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

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
    device: str = "cpu"  # where the messages live: a CUDA group's (NCCL) are on the rank's GPU

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def receive(self, tokens: int, hidden: int, dtype: torch.dtype, tag: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's (hidden state, residual) [T, hidden] each, sent as one [2, T, hidden] message."""
        both = torch.empty(2, tokens, hidden, dtype=dtype, device=self.device)
        dist.recv(both, self.prev, tag=tag)
        return both[0], both[1]

    def send(self, x: torch.Tensor, residual: torch.Tensor, tag: int = 0) -> dist.Work:
        """Start sending (x, residual) to the next stage → its handle (wait() before the step ends);
        the message holds its own copy, so the caller may go on at once."""
        return dist.isend(torch.stack((x, residual)), self.next, tag=tag)

    def share_logits(self, logits: torch.Tensor | None, rows: int, vocab: int) -> torch.Tensor:
        """The last stage's float32 logits [rows, vocab], on every rank."""
        if logits is None:
            logits = torch.empty(rows, vocab, dtype=torch.float32, device=self.device)
        dist.broadcast(logits.contiguous(), self.logits_from)
        return logits


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step, as a stage computes it: built (its attention metadata prepared)
    right before its turn, since a backend keeps one step's metadata at a time."""
    tokens: int  # T: its tokens (every stage knows them from the plan)
    rows: int  # its logits rows
    build: Callable[[], tuple[torch.Tensor, object, torch.Tensor]]  # → (input_ids [T], meta, logits_indices)


class StageForward:
    """A stage's part of a step: its forward (one micro-batch, model.forward's signature) and
    run (several in flight). Counts what it computed (micro_batches, steps) for tests and benches."""

    def __init__(self, model: nn.Module, link: PipeLink, vocab: int, hidden: int) -> None:
        self.model, self.link, self.vocab, self.hidden = model, link, vocab, hidden
        self.micro_batches = 0  # micro-batches this stage has computed
        self.steps = 0

    def __call__(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor) -> torch.Tensor:
        """One micro-batch: the model's forward."""
        return self.run([MicroBatch(input_ids.shape[0], logits_indices.shape[0],
                                    lambda: (input_ids, meta, logits_indices))])

    def run(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Every micro-batch through this stage, in order, sends left in flight → the float32
        logits of all of them [sum of rows, vocab], in order, on every rank."""
        link, sends, parts = self.link, [], []
        for i, mb in enumerate(micro_batches):
            logits = self._compute(i, mb)
            if link.last:
                parts.append(logits)
            else:
                sends.append(link.send(*logits, tag=i))
        for work in sends:  # the next stage has received every micro-batch once these end
            work.wait()
        self.steps += 1
        rows = sum(mb.rows for mb in micro_batches)
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts)) if link.last else None
        return link.share_logits(logits, rows, self.vocab)

    def _compute(self, i: int, mb: MicroBatch):
        """Micro-batch i on this stage → its logits (the last stage) or its (x, residual) to send."""
        model, link = self.model, self.link
        input_ids, meta, logits_indices = mb.build()
        if link.first:
            x, residual = model.embed(input_ids), None  # [T, hidden]
        else:
            x, residual = link.receive(mb.tokens, self.hidden, model.norm.weight.dtype, tag=i)
        for layer in model.layers:
            x, residual = layer(x, residual, model.rope, meta, model.ops)
        self.micro_batches += 1
        if not link.last:
            return x, residual
        if mb.rows == 0:  # nothing sampled in it (a prefill chunk's middle)
            return torch.empty(0, self.vocab, dtype=torch.float32, device=x.device)
        return model.head(x, residual, logits_indices).float()


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
        and head), sending and receiving at the stage boundaries; model.pipeline runs several
        micro-batches in flight (StageForward.run)."""
        model.pipeline = StageForward(model, link, self.full.vocab_size, self.full.hidden_size)
        model.forward = model.pipeline


def split_by_request(tokens: list[int], parts: int) -> list[range]:
    """Requests 0..n-1 with these token counts → at most `parts` contiguous, non-empty ranges of
    them, cut where the running token count crosses each 1/parts of the total (so a long prefill
    chunk and many decodes end up in micro-batches of similar work)."""
    n = len(tokens)
    parts = max(1, min(parts, n))
    total = sum(tokens)
    cuts, seen = [0], 0
    for i in range(n - 1):
        seen += tokens[i]
        need, left = parts - len(cuts), n - (i + 1)  # micro-batches still to open, requests after i
        if need and left >= need and (seen * parts >= total * len(cuts) or left == need):
            cuts.append(i + 1)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def _layer_of(name: str) -> int | None:
    """The decoder layer index in an HF tensor name (model.layers.12.mlp...), or None."""
    marker = "layers."
    at = name.find(marker)
    if at < 0:
        return None
    digits = name[at + len(marker):].split(".", 1)[0]
    return int(digits) if digits.isdigit() else None
