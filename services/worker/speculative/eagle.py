"""EAGLE and EAGLE-3 drafting (--speculative-algorithm EAGLE|EAGLE3): a one-layer head over the
target's own hidden states (seed §4.9; the head: speculative/eagle_head.py).

The target computes every token's hidden states anyway; the model captures the layers the head
reads (EAGLE-3: three, fused by the head's `fc`; EAGLE: the last) for every token a step computes,
and the runner hands this drafter each request's rows (`observe`): all of a prefill chunk's, and
of a verify item only the root's and the accepted tokens'. A head entry at position j pairs the
target's feature at j with the embedding of token j + 1 and predicts token j + 2, so the head
keeps a KV cache of its own per request: entries from the target's true features (kept), then,
while drafting, entries from its own outputs (dropped after each proposal).

A proposal runs the head once over the features observed since the last one (their next tokens
are known by then), then `--speculative-num-steps` - 1 more steps, each feeding a drafted token
and the head's own output hidden state back. With `--speculative-eagle-topk` k > 1 each step
expands the k best nodes so far by cumulative log-probability into k children each and keeps the
k best as the next frontier; the proposal is the best `--speculative-num-draft-tokens` - 1 nodes
of everything expanded, ancestor-closed, flattened parents first: a DraftTree the runner verifies
in one target step under a tree mask. With k = 1 it is a chain of argmax tokens (a plain list).
Drafts are deterministic, so the verify's exactness argument (drafter.py) holds unchanged.

Requests draft one after another (each its own head cache); the head's matmuls are small next to
the target's, and a single stream is what speculation is for (the scheduler turns it off above
--speculative-disable-batch-size).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.model_path import DEFAULT_MODEL_ID
from services.worker.speculative.drafter import DraftRequest
from services.worker.speculative.eagle_head import EagleHead, HeadKV
from services.worker.speculative.head_quant import quantize_linears
from services.worker.speculative.tree import DraftTree

log = logging.getLogger(__name__)

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")
# the model id (ModelConfig.name) → the EAGLE-3 head shipped for it, under HEADS_DIR
SHIPPED_HEADS = {DEFAULT_MODEL_ID: "smollm2-135m-instruct-eagle3"}
# Observed rows a request may hold before they run through the head without a proposal: one that
# is not drafting (the scheduler's cost model said no, or the batch is large) would otherwise keep
# every token's features (3 layers' hidden states, 6.9 KB a token for the default model) until it
# drafts again or ends.
PENDING_LIMIT = 256


@dataclass
class _Stream:
    """One request's head state."""
    tokens: list[int]  # prompt and accepted output
    cache: HeadKV
    n_true: int = 0  # cache entries [0, n_true) come from the target's features
    pending_last: int = -1  # the position of the last true entry run (its row drafts the first token)
    pending_pos: list[int] = field(default_factory=list)  # observed features not yet run through the head
    pending_aux: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] each


@dataclass
class _Node:
    token: int  # target vocabulary id
    parent: int  # index into the node list; -1: the root
    depth: int
    score: float  # cumulative log-probability under the head
    hidden: torch.Tensor | None = None  # [H] the head's output at the row that drafted this node's token
    entry: int = -1  # this node's own cache entry (once it is expanded)


class EagleDrafter:
    def __init__(self, head: EagleHead, topk: int, num_steps: int, num_draft_tokens: int):
        self.head = head
        self.topk = topk
        self.num_steps = num_steps
        self.tree_budget = num_steps if topk == 1 else max(num_draft_tokens - 1, 1)
        self.streams: dict[str, _Stream] = {}
        self.param = next(p for p in head.parameters() if p.dtype == head.dtype)  # the dtype and device of its state

    @classmethod
    def from_config(cls, config: Any, runner: Any) -> "EagleDrafter":
        """The head at --speculative-draft-model-path (or the one shipped for the default model; for
        NEXTN the checkpoint's own MTP layer), on the target's embedding (and LM head, for EAGLE and
        NEXTN), capturing the layers it reads."""
        model, mc = runner.model, runner.model_config
        refusal = model.aux_capture_refusal() if hasattr(model, "aux_capture_refusal") else None
        if refusal:
            raise ValueError(f"--speculative-algorithm {config.speculative_algorithm}: {refusal}")
        head, source = load_head(config, model, mc)
        quantized = quantize_linears(head) if config.device == "cpu" else 0  # a draft step reads ~4x fewer bytes
        model.set_aux_layers(tuple(head.config.capture_layers))
        log.info("%s head %s: draft vocabulary %d, capture layers %s, %d steps, topk %d, %d linears on int8",
                 config.speculative_algorithm, source, head.config.draft_vocab_size, list(head.config.capture_layers),
                 config.speculative_num_steps, config.speculative_eagle_topk, quantized)
        return cls(head, config.speculative_eagle_topk, config.speculative_num_steps,
                   config.speculative_num_draft_tokens)

    # --- the Drafter protocol ---------------------------------------------------------
    def admit(self, rid: str, tokens: list[int]) -> None:
        p = self.param
        self.streams[rid] = _Stream(list(tokens), HeadKV.empty(self.head.config, p.dtype, p.device))

    def extend(self, rid: str, tokens: list[int]) -> None:
        s = self.streams[rid]
        s.tokens += tokens
        if len(s.pending_pos) >= PENDING_LIMIT:
            self._catch_up(s)

    def release(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def observe(self, rid: str, start_pos: int, aux: torch.Tensor) -> None:
        """The target computed positions start_pos .. start_pos + n - 1 of the request, with these
        captured features aux [n, F] (a verify item: its root and accepted tokens only)."""
        s = self.streams.get(rid)
        if s is None or aux.shape[0] == 0:
            return
        s.pending_pos += range(start_pos, start_pos + aux.shape[0])
        s.pending_aux.append(aux)

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest], hidden: Any = None) -> list[list[int] | DraftTree]:
        return [self._propose_one(self.streams[r.rid], min(r.depth, self.num_steps)) if r.depth > 0 else []
                for r in batch]

    # --- one request --------------------------------------------------------------------
    def _propose_one(self, s: _Stream, depth: int) -> list[int] | DraftTree:
        last = self._absorb(s)
        if last is None:
            return []
        logits, hidden = last  # [draft V] float32, [H]: the last true row's
        nodes = [_Node(tok, -1, 1, score, hidden) for tok, score in self._top(logits, 0.0)]
        frontier = list(range(len(nodes)))
        base = s.pending_last + 1  # the position of a depth-1 node's own head row
        for level in range(1, depth):
            frontier = self._expand(s, nodes, frontier, base + level - 1)
        s.cache.keep(s.n_true)
        return self._select(nodes, depth)

    def _absorb(self, s: _Stream) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run the head over the pending true features (dropping the last proposal's draft
        entries first) → the last row's (draft logits, out hidden); None without features."""
        s.cache.keep(s.n_true)
        if not s.pending_pos:
            return None
        positions, aux = s.pending_pos, torch.cat(s.pending_aux)
        s.pending_pos, s.pending_aux = [], []
        if s.n_true and int(s.cache.positions[s.n_true - 1]) >= positions[0]:  # recomputed positions: redo them
            s.n_true = int((s.cache.positions[:s.n_true] < positions[0]).sum())
            s.cache.keep(s.n_true)
        usable = [i for i, j in enumerate(positions) if j + 1 < len(s.tokens)]
        if not usable:
            return None
        positions = [positions[i] for i in usable]
        aux = aux[usable].to(self.param.dtype)  # [n, F]
        nxt = torch.tensor([s.tokens[j + 1] for j in positions], dtype=torch.int64)
        logits, out = self.head.step(self.head.embed(nxt), self.head.fuse(aux),
                                     torch.tensor(positions, dtype=torch.int64), s.cache)
        s.n_true = len(s.cache)
        s.pending_last = positions[-1]
        return logits[-1], out[-1]

    @torch.inference_mode()
    def _catch_up(self, s: _Stream) -> None:
        """Run every pending row but the newest through the head now, as one step; the newest stays
        pending, so the next proposal still drafts from its row."""
        aux = torch.cat(s.pending_aux)
        newest_pos, newest_aux = s.pending_pos[-1], aux[-1:]
        s.pending_pos, s.pending_aux = s.pending_pos[:-1], [aux[:-1]]
        self._absorb(s)
        s.pending_pos, s.pending_aux = [newest_pos], [newest_aux]

    def _expand(self, s: _Stream, nodes: list[_Node], frontier: list[int], position: int) -> list[int]:
        """One head step over the frontier's nodes (each attending to the true entries and its own
        ancestors' draft entries) → the next frontier: the topk best of their children."""
        n_old = len(s.cache)
        attend = None  # a chain (topk 1): the cache holds the true entries and the node's ancestors, all attended
        if self.topk > 1:
            attend = torch.zeros(len(frontier), n_old + len(frontier), dtype=torch.bool)
            attend[:, :s.n_true] = True
            for row, i in enumerate(frontier):
                attend[row, n_old + row] = True
                parent = nodes[i].parent
                while parent >= 0:
                    attend[row, nodes[parent].entry] = True
                    parent = nodes[parent].parent
        tokens = torch.tensor([nodes[i].token for i in frontier], dtype=torch.int64)
        hidden = torch.stack([nodes[i].hidden for i in frontier])
        positions = torch.full((len(frontier),), position, dtype=torch.int64)
        logits, out = self.head.step(self.head.embed(tokens), hidden, positions, s.cache, attend)
        children = []
        for row, i in enumerate(frontier):
            nodes[i].entry = n_old + row
            for tok, score in self._top(logits[row], nodes[i].score):
                children.append(len(nodes))
                nodes.append(_Node(tok, i, nodes[i].depth + 1, score, out[row]))
        children.sort(key=lambda c: -nodes[c].score)
        return children[:self.topk]

    def _top(self, logits: torch.Tensor, score: float) -> list[tuple[int, float]]:
        """The topk draft tokens of one row → (target id, cumulative log-probability)."""
        if self.topk == 1:
            best = logits.argmax().reshape(1)
            return [(int(self.head.to_target_ids(best)[0]), score)]
        logp = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logp.topk(self.topk)
        targets = self.head.to_target_ids(ids)
        return [(int(t), score + float(v)) for t, v in zip(targets, values)]

    def _select(self, nodes: list[_Node], depth: int) -> list[int] | DraftTree:
        """The best tree_budget nodes of depth <= depth, ancestor-closed, parents first."""
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))
        taken: set[int] = set()
        for i in order:
            if len(taken) == self.tree_budget:
                break
            if nodes[i].depth <= depth and (nodes[i].parent < 0 or nodes[i].parent in taken):
                taken.add(i)
        flat = sorted(taken, key=lambda i: (nodes[i].depth, i))
        index = {node: k + 1 for k, node in enumerate(flat)}  # tree node numbers: 0 is the root
        tree = DraftTree([nodes[i].token for i in flat], [index.get(nodes[i].parent, 0) for i in flat])
        return tree.tokens if tree.is_chain() else tree


def load_head(config: Any, model: Any, mc: Any) -> tuple[Any, str]:
    """The draft head the flags name → (head, where it came from). EAGLE/EAGLE3: an SGLang-format
    head directory; NEXTN: the target checkpoint's MTP layer (speculative/nextn_head.py)."""
    algorithm = config.speculative_algorithm
    embed, lm_head = target_tables(model, mc)
    if algorithm == "NEXTN":
        from services.common.model_path import resolve_model_path
        from services.worker.speculative.nextn_head import load_nextn_head
        path = config.speculative_draft_model_path or resolve_model_path(config.model)
        return load_nextn_head(path, embed, lm_head, mc.num_hidden_layers, mc.rope_theta), path
    path = resolve_head_path(algorithm, config.speculative_draft_model_path, mc.name)
    head = EagleHead.load(path, embed, lm_head, mc.num_hidden_layers,
                          target_norm=model.norm.weight.detach().float())  # EAGLE reads the normed last layer
    if head.config.eagle3 != (algorithm == "EAGLE3"):
        kind = "an EAGLE-3" if head.config.eagle3 else "an EAGLE (v1)"
        raise ValueError(f"--speculative-draft-model-path {path} holds {kind} head; use "
                         f"--speculative-algorithm {'EAGLE3' if head.config.eagle3 else 'EAGLE'}")
    return head, path


def resolve_head_path(algorithm: str, path: str | None, model_name: str) -> str:
    """--speculative-draft-model-path, or the head shipped for the target model (EAGLE3 only)."""
    if path:
        return path
    shipped = SHIPPED_HEADS.get(model_name) if algorithm == "EAGLE3" else None
    if shipped is None:
        raise ValueError(f"--speculative-algorithm {algorithm} drafts with a head trained for the target: give its "
                         f"directory with --speculative-draft-model-path (SGLang's format; `radixmesh train-draft` "
                         f"trains one). A head ships for {sorted(SHIPPED_HEADS)} with EAGLE3 only")
    found = os.path.join(HEADS_DIR, shipped)
    if not os.path.isfile(os.path.join(found, "config.json")):
        raise ValueError(f"the EAGLE-3 head shipped for {model_name} is missing from {found}: reinstall radixmesh, "
                         "or give --speculative-draft-model-path")
    return found


def target_tables(model: Any, mc: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's token embedding [V, H] (dense, looked up once whatever its format) and its LM
    head [V, H] when tied to it (EAGLE (v1) drafts through the target's head); an untied head
    comes back dense when it is held so, else None (an EAGLE-3 head has its own)."""
    with torch.inference_mode():
        embed = model.embed(torch.arange(mc.vocab_size, dtype=torch.int64)).float()  # [V, H]
    if mc.tie_word_embeddings:
        return embed, embed
    weight = getattr(getattr(model, "lm_head", None), "weight", None)
    dense = isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point and weight.shape == embed.shape
    return embed, weight.detach().float() if dense else None
