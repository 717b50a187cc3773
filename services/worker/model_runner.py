"""The worker's core: executes a StepPlan on the model and the KV pool.

It keeps per-request state (page-table row, token history, sampling params)
so the scheduler only sends deltas, builds the step's index tensors once,
runs one forward for the whole batch and samples every row at once.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from services.common.grammar.backend import Matcher, create_backend as create_grammar_backend
from services.common.sampling_params import SamplingParams
from services.step.contract import LAST_SAMPLED, NewRequestSpec, StepPlan, StepResult, TokenRun
from services.worker.attention.backend import DecodeStep, create_backend
from services.worker.attention.batch_layout import BatchLayout
from services.worker.config import EAGLE_ALGORITHMS, WorkerConfig
from services.worker.grammar_cache import GrammarCache
from services.worker.deferred_step import DeferredStep
from services.worker.device_stats import DeviceStats
from services.worker.disaggregation import KVSender, check_device as check_pd_device, decode_pool_storage, is_disaggregated
from services.worker.grammar_vocab import grammar_vocab
from services.worker.host_to_device import to_device
from services.worker.jump_forward import accepted, draft, plain_verify_rows, verify_rows
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.loader.checkpoint import Checkpoint
from services.worker.lora.manager import LoraManager
from services.worker.model.config import ModelConfig
from services.worker.model.layer_ops import create_layer_ops
from services.worker.model.llama import LlamaForCausalLM
from services.worker.model.registry import model_class
from services.worker.model.weight_bytes import format_bytes, resident_weight_bytes, weight_formats
from services.worker.parallel.communicator import Communicator, Solo
from services.worker.parallel.pipeline import MicroBatch, PipeLink, PipelineStage, split_by_request
from services.worker.model.expert_load import ExpertLoadRecorder
from services.worker.parallel.moe_parallel import install_expert_parallel, rank_expert_slots
from services.worker.parallel.rank_part import RankPart
from services.worker.parallel.tensor_parallel import TensorShard
from services.worker.prompt_extras import StepExtras, plan_extras, wants_extras
from services.worker.sampler_inputs import run_sampler
from services.worker.speculative.drafter import Drafter, DraftRequest, create_drafter
from services.worker.speculative.tree import DraftTree
from services.worker.speculative.tree_verify import compact_accepted, tree_of, tree_rows

log = logging.getLogger(__name__)


@dataclass
class _Request:
    row: int
    prompt_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    seed: int
    num_pages: int = 0
    matcher: Matcher | None = None  # its constraint's grammar state, advanced with every sampled token
    drafted_speculatively: bool = False  # its last draft came from the drafter, not its grammar
    adapter: str = ""  # the LoRA adapter it runs under ("" = the base model)
    unapplied: int = 0  # tokens sampled on the device whose deferred step has not been finished yet
    wants_extras: bool = False  # prompt logprobs or an embedding still to compute (prompt_extras.py)
    pool_sum: torch.Tensor | None = None  # mean pooling: the final hidden states' sum so far [H] float32
    pool_count: int = 0
    draft_tree: DraftTree | None = None  # its last speculative draft, when that branches


@dataclass
class _ForwardMeta:
    positions: torch.Tensor  # [T]
    attention: object  # the backend's forward(layer, q, k, v)


class ModelRunner:
    kv_transfer = None  # HiCache tiers (services/worker/host_pool.KVTransfer), attached by the engine/service
    # Called once a step's inputs are ready, right before its compute (the worker service posts
    # the previous step's result then: services/worker/step_loop.py). Must be cheap.
    on_compute: Callable[[], None] | None = None

    def __init__(self, config: WorkerConfig, checkpoint: Checkpoint, comm: Communicator | None = None,
                 pipe: PipeLink | None = None):
        """comm: this rank's tensor-parallel group, pipe: its pipeline stage's links
        (services/worker/parallel); None: a group of one."""
        if config.num_threads:  # every backend's torch ops
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {config.device}: torch sees no CUDA device (torch {torch.__version__}, "
                             f"built for CUDA {torch.version.cuda}); use --device cpu")
        mc = checkpoint.config
        if config.context_length:
            mc = _with_context(mc, config.context_length)
        self.model_config: ModelConfig = mc  # the whole model's; its shard's (local) is self.model.config
        self.comm = comm or Solo()
        self.shard: TensorShard | None = None
        stage: PipelineStage | None = None
        local = mc  # the model this rank computes
        if self.comm.world_size > 1 or pipe is not None:  # a group's rank: its layers, heads, MLP share, vocabulary rows
            rank = (pipe.rank if pipe else 0) * self.comm.world_size + self.comm.rank
            part = RankPart(mc, rank, self.comm.world_size, pipe.size if pipe else 1,
                            rank_expert_slots(config, mc, rank), config.enable_dp_attention)
            checkpoint = _rank_checkpoint(checkpoint, part)
            stage, self.shard, local = part.stage, part.shard, part.config
        self.model = build_model(local, checkpoint.tensors, config.torch_dtype, self.device,
                                 checkpoint.quantized, config.quantization)
        if self.shard is not None:
            self.shard.install(self.model, self.comm)
        if stage is not None:
            stage.install(self.model, pipe)
        # MoE: the tokens each expert is routed (/metrics, EPLB); with --ep-size, the all-to-all dispatch.
        self.expert_load = ExpertLoadRecorder.install(self.model)
        self.expert_parallel = (install_expert_parallel(self.model, self.expert_load, config, mc, self.comm.rank)
                                if config.ep_size > 1 else None)
        # oneDNN prepacking is a CPU layout; on CUDA the linears run on the dense weights.
        self.prepacked = config.prepack_weights and self.device.type == "cpu" and self.model.prepack_weights()
        self.model.ops = create_layer_ops(config.fused_ops, self.device)
        # The backend's own tuning (the cpu backend's allocator, quantized weights, one-call decode steps).
        self.backend = create_backend(config.resolved_attention_backend, scale=mc.head_dim ** -0.5,
                                      sliding_window=mc.sliding_window)
        self.attach_backend(checkpoint)
        self.kv_spec = KVPoolSpec.from_budget(  # this rank's KV heads (MLA: one latent row)
            local, config.page_size, config.kv_torch_dtype,  # FP8 (--kv-cache-dtype): the budget holds 2x the tokens
            None if config.kv_mem_fraction else config.kv_cache_bytes, config.kv_mem_fraction, self.device)
        # CUDA graphs pad decode steps with rows that write one scratch page past the scheduler's.
        check_pd_device(config, self.device)
        self.pool = KVPool(self.kv_spec, self.device, extra_pages=1 if config.uses_cuda_graphs else 0,
                           storage=decode_pool_storage(config))
        # Disaggregation: the transfer engine that sends this pool's pages, or receives into them.
        self.kv_sender: KVSender | None = KVSender(config, self.pool) if is_disaggregated(config) else None
        max_pages = -(-mc.max_position_embeddings // config.page_size)
        self.page_table = torch.zeros((config.max_requests, max_pages), dtype=torch.int64)
        self.free_rows = list(range(config.max_requests - 1, -1, -1))
        self.requests: dict[str, _Request] = {}
        self._extra_rids: set[str] = set()  # requests whose prompt rows a step must return (prompt_extras.py)
        self._step_extras: tuple[list, list] | None = None  # the last compute_logits' prompt logprobs, embeddings
        self.device_stats = DeviceStats(self.device)  # launch vs device time, graph replays (/metrics)
        # Each page-table row's last sampled token, on the device: a LAST_SAMPLED input of a request
        # whose previous step is still deferred is gathered from here, never from the host.
        self.last_token = torch.zeros(config.max_requests, dtype=torch.int64, device=self.device)
        self._deferred: DeferredStep | None = None  # services/worker/deferred_step.py
        # LoRA adapters (services/worker/lora): loaded on the host, up to --max-loras resident in slots;
        # None: --max-loras 0, no LoRA serving.
        self.max_loras = config.max_loras
        self.loras: LoraManager | None = LoraManager(
            self.model, config.max_loras, config.max_lora_rank,
            in_use=lambda name: any(r.adapter == name for r in self.requests.values()),
            shard_pair=self.shard.lora_pair if self.shard else None) if config.max_loras else None
        for name, path in config.lora_adapters:
            self.loras.load(name, path)
        self.grammars = GrammarCache(lambda: create_grammar_backend(
            config.grammar_backend, grammar_vocab(checkpoint.source, mc.vocab_size, list(mc.eos_token_ids))),
            config.grammar_cache_size)
        self.drafter: Drafter | None = (create_drafter(config.speculative_algorithm, config, self)
                                        if config.speculative_algorithm else None)
        self.max_draft_tokens = (0 if self.drafter is None else config.speculative_num_steps
                                 if config.speculative_algorithm in EAGLE_ALGORITHMS else config.speculative_num_draft_tokens)
        # A drafter that reads the target's hidden states is handed each step's captured rows.
        self.observes = self.drafter is not None and hasattr(self.drafter, "observe")
        self._step_trees: dict[int, DraftTree] = {}  # plan item index → the tree its verify item checks
        self.graphs = None  # services/worker/cuda_graphs.DecodeGraphs, captured last (CUDA)
        if config.uses_cuda_graphs:
            self.capture_graphs()
        self.weight_bytes = resident_weight_bytes(self.model)  # services/worker/model/weight_bytes.py
        log.info("weights: --quantization %s, %s resident (%s)", config.quantization,
                 format_bytes(self.weight_bytes), weight_formats(self.model))
        log.info("worker ready: %s %s, %s, %s, %s%s, %d KV pages x %d tokens "
                 "(%d tokens of %s KV, %.2f GiB)", mc.name,
                 config.resolved_dtype, "prepacked linears" if self.prepacked else "plain linears",
                 f"file's quantized weights for steps of <= {config.quant_max_rows} tokens "
                 f"({self.quantized_weights} weights)" if self.quantized_weights else "no quantized weights",
                 type(self.model.ops).__name__, ", one-call decode steps" if self.decode_stack else "", self.kv_spec.num_pages,
                 self.kv_spec.page_size, self.kv_spec.capacity_tokens, self.kv_spec.dtype_name,
                 self.kv_spec.total_bytes / 2**30)

    def attach_backend(self, checkpoint: Checkpoint) -> None:
        """Let the backend tune itself to the model and `checkpoint` (quantized blocks, one-call
        decode steps), and take its answer; again after a weight update."""
        attached = self.backend.attach(self.model, self.config, checkpoint, self.prepacked)
        self.quantized_weights, self.one_call_rows = attached.quantized_weights, attached.one_call_rows
        self.decode_stack = self.one_call_rows > 0
        # Steps with a verify item run as one call up to this many tokens (the stack's rows
        # are computed independently of each other: a verify gives the logits decoding would).
        self.verify_rows = self.config.verify_max_rows if self.decode_stack else 0

    def capture_graphs(self) -> None:
        """Capture the decode CUDA graphs. They hold the weights' addresses: weight updates copy in
        place on CUDA (services/worker/weights/swap.py), so the graphs stay valid across them."""
        from services.worker.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, self.config.cuda_graph_max_bs, scratch_page=self.kv_spec.num_pages)
        self.device_stats.graph_capture_seconds = self.graphs.capture()

    def forward_meta(self, positions: torch.Tensor) -> "_ForwardMeta":
        """What the model's layers see of a step: positions [T] and the backend's attention."""
        return _ForwardMeta(positions, self.backend.forward)

    # --- request state -------------------------------------------------------------
    def _admit(self, spec: NewRequestSpec) -> None:
        if spec.adapter and (self.loras is None or spec.adapter not in self.loras):
            loaded = [info.name for info in self.loras.infos()] if self.loras is not None else []
            raise ValueError(f"request {spec.rid}: LoRA adapter {spec.adapter!r} is not loaded on this worker "
                             f"(loaded: {loaded})")
        old = self.requests.pop(spec.rid, None)
        if old is not None:
            self.free_rows.append(old.row)
        if not self.free_rows:
            raise RuntimeError(f"worker holds {self.config.max_requests} requests already "
                               "(scheduler's max_running_requests exceeds the worker's)")
        req = self.requests[spec.rid] = _Request(self.free_rows.pop(), list(spec.prompt_ids),
                                                 list(spec.output_ids), spec.sampling, spec.seed,
                                                 adapter=spec.adapter)
        if wants_extras(spec.sampling, req.output_ids):
            req.wants_extras = True
            self._extra_rids.add(spec.rid)
        if spec.sampling.constraint is not None:
            req.matcher = self.grammars.matcher(spec.sampling.constraint)
            for token in req.output_ids:  # re-admitted after a retraction: replay what it generated
                req.matcher.accept_token(token)
        if self.drafter is not None:
            self.drafter.admit(spec.rid, req.prompt_ids + req.output_ids)

    def _release(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        self._extra_rids.discard(rid)
        if req is not None:
            self.free_rows.append(req.row)
            if self.drafter is not None:
                self.drafter.release(rid)

    def _append_pages(self, req: _Request, pages: list[int], reset: bool) -> None:
        start = 0 if reset else req.num_pages
        if pages:
            self.page_table[req.row, start:start + len(pages)] = torch.tensor(pages, dtype=torch.int64)
        req.num_pages = start + len(pages)

    def reset(self) -> None:
        """Forget every request (a new scheduler connection starts from nothing)."""
        self._deferred = None
        for rid in list(self.requests):
            self._release(rid)

    def close(self) -> None:
        """Drop every tensor and native object the runner holds (weights, KV pool, page table,
        adapters, grammars, drafter, graphs, tiers), so that their memory goes back when this
        returns, whoever still holds the runner. The runner cannot step afterwards."""
        self.reset()
        if self._weight_groups is not None:
            self._weight_groups.close_all()
        if getattr(self, "kv_sender", None) is not None:
            self.kv_sender.close()
        for name in ("model", "pool", "backend", "page_table", "last_token", "loras", "grammars", "drafter",
                     "graphs", "kv_transfer", "_weight_groups", "kv_sender"):
            setattr(self, name, None)

    # --- the step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, defer: bool = False) -> StepResult:
        """Run one plan → its result. defer: a step of plain rows (no grammar, logprobs, drafter or
        verify item) may return before its sampled tokens reach the host; its result's rids,
        tokens and logprobs are filled by finish_pending(), which the next step's sampling calls
        first (the worker's step loop calls it once the next step is queued on the device, so the
        copy back is off the critical path; services/worker/step_loop.py)."""
        t0 = time.perf_counter()
        # Release before admitting: a finished request's row is free for a new one in
        # the same step (the scheduler never lists a re-admitted request as released).
        for rid in plan.released_rids:
            self._release(rid)
        for spec in plan.new_requests:
            self._admit(spec)
        result = StepResult(step_id=plan.step_id)
        if plan.kv_copies:  # tier moves the forward may read: first
            self._computing()
            result.kv_transfers = self.kv_transfer.run(plan.kv_copies)
        if plan.items:
            self._run_items(plan, result, defer)
        if plan.kv_sends:  # disaggregation: pages this step (or one before it) completed
            result.kv_sends = self.kv_sender.run(plan.kv_sends)
        result.forward_seconds = time.perf_counter() - t0
        return result

    @property
    def has_deferred(self) -> bool:
        return self._deferred is not None

    def finish_pending(self) -> None:
        """Complete the deferred step's result: wait for its tokens' copy (long done when the next
        step is already queued behind it), apply them to the requests, fill its result."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            deferred.complete(self._take)

    def _run_items(self, plan: StepPlan, result: StepResult, defer: bool = False) -> None:
        logits, sampled = self.compute_logits(plan)  # [R, V]: a row per sampled item, per position of a verify item
        aux = self.model.aux_hidden if self.observes else None  # [T, F]: the drafter's features of every token
        self.finish_pending()  # the previous step's tokens reach the requests before this step samples
        if self._step_extras is not None:  # prompt logprobs, embeddings (prompt_extras.py)
            (result.prompt_logprobs, result.embeddings), self._step_extras = self._step_extras, None
        if not sampled:
            self._observe(plan.items, aux, {})
            return
        items = [plan.items[i] for i in sampled]
        reqs = [self.requests[item.rid] for item in items]
        verifying = any(item.verify for item in items)  # jump-forward; the common step has one row per item
        if defer and not verifying and self.drafter is None and all(
                r.matcher is None and not r.sampling.logprobs for r in reqs):
            self._defer(logits, items, reqs, result)
            return
        trees = [self._step_trees.get(i) for i in sampled]
        rows, spans = self._verify_rows(reqs, items, trees) if verifying else (reqs, None)
        grammar = self.grammars.backend if any(r.matcher is not None for r in rows) else None
        picked, logprobs = run_sampler(logits, rows, self.model_config.eos_token_ids, grammar, self.grammars.stats)
        kept: dict[int, list[int]] = {}  # plan item index → the verify item's rows that stay (root, accepted)
        if spans is None:
            runs = [[token] for token in picked]
        else:
            runs = [self._accept(i, req, item, tree, picked[lo:hi], kept) if item.verify else [picked[lo]]
                    for i, req, item, tree, (lo, hi) in zip(sampled, reqs, items, trees, spans)]
            logprobs = [logprobs[lo] for lo, _ in spans]
        self._observe(plan.items, aux, kept)
        if verifying:  # the tokens a grammar forced (a speculative draft's are the scheduler's to count)
            self.grammars.stats.jump_forward_tokens += sum(
                len(run) - 1 for req, run in zip(reqs, runs) if not req.drafted_speculatively)
        forced = [self._take(req, item.rid, run) for req, item, run in zip(reqs, items, runs)]  # grammars' drafts
        proposed = self._speculate(reqs, items, runs, forced, result) if self.drafter is not None else {}
        result.rids += [item.rid for item in items]
        result.next_token_ids += [run[0] for run in runs]
        result.logprobs += logprobs
        if verifying:
            result.accepted = [TokenRun(run[1:]) for run in runs]
        if proposed or any(forced):
            result.drafts = [TokenRun(proposed[i], speculative=True) if i in proposed else TokenRun(ids)
                             for i, ids in enumerate(forced)]

    def _accept(self, index: int, req: _Request, item, tree: DraftTree | None, picks: list[int],
                kept: dict[int, list[int]]) -> list[int]:
        """A verify item's tokens: the draft's prefix the picks agree with, plus the pick after it.
        A tree's accepted path moves to contiguous KV (tree_verify.compact_accepted)."""
        if tree is None:
            run = accepted(item.input_ids[1:], picks)
            kept[index] = list(range(len(run)))
            return run
        run, nodes = tree.accept(picks)
        compact_accepted(self.pool, self.page_table[req.row], self.kv_spec.page_size, item.start_pos, nodes)
        kept[index] = [0, *nodes]
        return run

    def _observe(self, items: list, aux: torch.Tensor | None, kept: dict[int, list[int]]) -> None:
        """Hand a hidden-state drafter each item's captured rows aux [T, F] (all of them, or a
        verify item's kept ones), before it drafts."""
        if aux is None:
            return
        first = 0
        for i, item in enumerate(items):
            n = len(item.input_ids)
            rows = aux[first:first + n] if i not in kept else aux[first + torch.tensor(kept[i], dtype=torch.int64)]
            self.drafter.observe(item.rid, item.start_pos, rows)
            first += n

    def _defer(self, logits: torch.Tensor, items: list, reqs: list[_Request], result: StepResult) -> None:
        """Sample on the device, record each row's token in last_token, and start the tokens'
        copy to the host; finish_pending completes `result`."""
        picked, _ = run_sampler(logits, reqs, self.model_config.eos_token_ids, None, self.grammars.stats,
                                to_host=False)  # [R] int64 on the device
        rows, = to_device([torch.tensor([r.row for r in reqs], dtype=torch.int64)], self.device)
        self.last_token.index_copy_(0, rows, picked)
        self._deferred = DeferredStep.start(picked, result, items, reqs)

    def _speculate(self, reqs: list[_Request], items: list, runs: list[list[int]], forced: list[list[int]],
                   result: StepResult) -> dict[int, list[int]]:
        """Tell the drafter every row's new tokens, then draft for the rows the scheduler asked
        (item.draft_depth) that have no grammar draft and want no logprobs (a draft's tokens
        get none) → row index → its speculative draft (non-empty ones only)."""
        t0 = time.perf_counter()
        for item, run in zip(items, runs):
            self.drafter.extend(item.rid, run)
        asked = [i for i, (req, item) in enumerate(zip(reqs, items))
                 if item.draft_depth > 0 and not forced[i] and not req.sampling.logprobs
                 and not (req.matcher is not None and req.matcher.terminated)]
        proposed: dict[int, list[int]] = {}
        if asked:
            room = [min(items[i].draft_depth, self.max_draft_tokens,
                        reqs[i].sampling.max_new_tokens - len(reqs[i].output_ids) - 1) for i in asked]
            drafts = self.drafter.propose([DraftRequest(items[i].rid, n) for i, n in zip(asked, room)])
            for i, draft_ in zip(asked, drafts):
                tree = draft_ if isinstance(draft_, DraftTree) else None
                if tree is not None or draft_:
                    proposed[i] = list(tree.tokens if tree is not None else draft_)
                    reqs[i].draft_tree = tree
        for i, req in enumerate(reqs):
            req.drafted_speculatively = i in proposed
            if i not in proposed:
                req.draft_tree = None
        result.draft_seconds += time.perf_counter() - t0
        return proposed

    def _verify_rows(self, reqs: list[_Request], items: list,
                     trees: list[DraftTree | None]) -> tuple[list, list[tuple[int, int]]]:
        """Sampler rows when a verify item is in the step: one per position of each verify item
        (jump_forward.verify_rows with a grammar, plain_verify_rows without, a tree's one per
        node), one per other item; and each item's slice of them."""
        rows, spans = [], []
        for req, item, tree in zip(reqs, items, trees):
            start = len(rows)
            if tree is not None:
                rows += tree_rows(req, tree)
            elif item.verify and req.matcher is not None:
                rows += verify_rows(req, item.input_ids[1:], self.grammars.backend)
            elif item.verify:
                rows += plain_verify_rows(req, item.input_ids[1:])
            else:
                rows.append(req)
            spans.append((start, len(rows)))
        return rows, spans

    def _take(self, req: _Request, rid: str, tokens: list[int]) -> list[int]:
        """Append a row's tokens and advance its grammar over them → the draft its grammar forces
        next (jump-forward; none for requests asking for logprobs: a draft's tokens get none)."""
        req.output_ids += tokens
        m = req.matcher
        if m is None:
            return []
        for token in tokens:
            if m.terminated or not m.accept_token(token):
                if not m.terminated:
                    log.warning("a sampled token broke its request's grammar", extra={"rid": rid, "token": token})
                return []
        if not self.config.jump_forward or req.sampling.logprobs or m.terminated:
            return []
        forced = draft(m, req.sampling.max_new_tokens - len(req.output_ids) - 1)
        return forced if len(forced) >= self.config.jump_forward_min_tokens else []

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """Run the plan's items (KV written) → (logits [R, V] of the sampled items: one row each,
        one per position for a verify item; their indices in plan.items). Requests must have
        been admitted."""
        if self._deferred is not None and self.graphs is None and self.one_call_rows:
            self.finish_pending()  # the CPU one-call step reads its token ids on the host
        reqs = [self.requests[item.rid] for item in plan.items]
        on_device: list[tuple[int, int]] = []  # (token index, page-table row) of LAST_SAMPLED inputs still deferred
        first = 0
        for req, item in zip(reqs, plan.items):
            if item.new_pages or item.reset_pages:
                self._append_pages(req, item.new_pages, item.reset_pages)
            if item.input_ids[0] == LAST_SAMPLED:
                item.input_ids = [_last_sampled(item.rid, req, item.start_pos)]
                if req.unapplied:
                    on_device.append((first, req.row))
            first += len(item.input_ids)
        sampled = [i for i, item in enumerate(plan.items) if item.sample]
        self._step_trees = {i: tree for i, (req, item) in enumerate(zip(reqs, plan.items))
                            if (tree := tree_of(item, req.draft_tree)) is not None} if self.observes else {}
        extras = None  # rows of prompt logprobs and embeddings, in steps that carry such requests only
        if self._extra_rids and not self._extra_rids.isdisjoint(item.rid for item in plan.items):
            extras = plan_extras(plan.items, reqs, self.config.pooling)
            self._extra_rids.difference_update(extras.done)
            for rid in extras.done:
                self.requests[rid].wants_extras = False
            return self._logits_with_extras(plan, reqs, sampled, extras, on_device), sampled
        if self.graphs is not None:  # CUDA: a pure-decode step replays its bucket's graph
            most = self.graphs.buckets[-1]  # a verify item's rows share its page-table row, as in one-call steps
            step = self._one_call(plan, reqs, max_rows=most, max_verify_rows=most)
            logits = self.device_stats.timed(lambda: self._replay(step, on_device), replayed=True)
            if logits is not None:
                return logits, sampled
        elif not self._step_trees and (step := self._one_call(plan, reqs)) is not None:  # CPU: one-call decode step
            logits = self.device_stats.timed(lambda: self.backend.one_call_step(step, self._computing))
            if logits is not None:
                return logits, sampled
        parts = self._micro_batches(plan.items)  # None: the step runs whole
        layout = self._layout(plan.items, reqs, self._step_trees) if parts is None else None
        flat_ids = [t for item in plan.items for t in item.input_ids]
        ends = list(itertools.accumulate(len(item.input_ids) for item in plan.items))
        wanted: list[int] = []  # the token indices whose logits come back
        for i in sampled:  # a verify item: every position's logits
            n = len(plan.items[i].input_ids) if plan.items[i].verify else 1
            wanted += range(ends[i] - n, ends[i])
        input_ids, logits_indices = to_device(
            [torch.tensor(flat_ids, dtype=torch.int64), torch.tensor(wanted, dtype=torch.int64)], self.device)
        self._fill_last_sampled(input_ids, on_device)
        meta = self.forward_meta(layout.positions) if parts is None else None
        lora = None  # the step's rows by adapter slot (services/worker/lora/batch.py); None: all base
        if self.loras is not None and any(req.adapter for req in reqs):
            lora = self.loras.batch([(req.adapter, len(item.input_ids)) for req, item in zip(reqs, plan.items)])
        with self.loras.active(lora) if lora is not None else contextlib.nullcontext():
            if self.device.type != "cuda":  # the CPU computes as it goes: post the previous result first
                self._computing()
            logits = self.device_stats.timed(
                lambda: self.model(input_ids, meta, logits_indices) if parts is None
                else self._pipelined(plan.items, reqs, parts, input_ids, wanted))
            if self.device.type == "cuda":  # queued on the GPU: post (and finish) the previous step meanwhile
                self._computing()
            return logits, sampled

    def _logits_with_extras(self, plan: StepPlan, reqs: list[_Request], sampled: list[int], extras: StepExtras,
                            on_device: list[tuple[int, int]]) -> torch.Tensor:
        """compute_logits for a step with prompt-logprob or embedding rows: op by op (never a
        one-call step or a graph), the extra rows' logits and final hidden states computed in the
        same forward; their entries wait in _step_extras for the step's result."""
        ends = list(itertools.accumulate(len(item.input_ids) for item in plan.items))
        wanted: list[int] = []
        for i in sampled:
            n = len(plan.items[i].input_ids) if plan.items[i].verify else 1
            wanted += range(ends[i] - n, ends[i])
        rows = wanted + extras.logit_rows
        parts = self._micro_batches(plan.items)
        flat = torch.tensor([t for item in plan.items for t in item.input_ids], dtype=torch.int64)
        input_ids, = to_device([flat], self.device)
        self._fill_last_sampled(input_ids, on_device)
        hidden = None
        if parts is not None:  # pipelined: rows ascending, then back in this order
            if extras.hidden_rows:
                raise ValueError("embeddings are not supported with pipeline parallelism")
            order = sorted(range(len(rows)), key=rows.__getitem__)
            out = self._pipelined(plan.items, reqs, parts, input_ids, [rows[i] for i in order])
            logits = torch.empty_like(out)
            logits[torch.tensor(order, device=out.device)] = out
        else:
            layout = self._layout(plan.items, reqs, self._step_trees)
            index, hidden_index = to_device([torch.tensor(rows, dtype=torch.int64),
                                             torch.tensor(extras.hidden_rows, dtype=torch.int64)], self.device)
            lora = None
            if self.loras is not None and any(req.adapter for req in reqs):
                lora = self.loras.batch([(req.adapter, len(item.input_ids)) for req, item in zip(reqs, plan.items)])
            with self.loras.active(lora) if lora is not None else contextlib.nullcontext():
                self._computing()
                out = self.model(input_ids, self.forward_meta(layout.positions), index,
                                 hidden_index if extras.hidden_rows else None)
            logits, hidden = out if extras.hidden_rows else (out, None)
        self._step_extras = extras.finish(logits[len(wanted):], hidden)
        return logits[:len(wanted)]

    def _fill_last_sampled(self, input_ids: torch.Tensor, on_device: list[tuple[int, int]]) -> None:
        """input_ids [T] on the device: the LAST_SAMPLED inputs whose step is still deferred take
        their row's last_token, device to device (their host value is a stale placeholder)."""
        if on_device:
            index, rows = to_device([torch.tensor(on_device, dtype=torch.int64).T.contiguous()], self.device)[0]
            input_ids.index_copy_(0, index, self.last_token.index_select(0, rows))

    def _replay(self, step: DecodeStep, on_device: list[tuple[int, int]]) -> torch.Tensor | None:
        """A decode step's logits [sampled rows, V] from its CUDA graph (a verify item's positions
        as rows of one page-table row, each attending through its own position: the backend writes
        every row's K/V before any attends); None when no bucket holds it."""
        if step is None:
            return None
        logits = self.graphs.run(step.token_ids, step.positions, step.rows,
                                 lambda token_ids: self._fill_last_sampled(token_ids, on_device))
        if logits is None:
            return None
        self._computing()  # the replay is queued: the previous result posts while the GPU runs it
        return logits[step.sampled]

    def _micro_batches(self, items: list) -> list[range] | None:
        """A pipelined step's micro-batches: contiguous ranges of its items, by request
        (pipeline.split_by_request), each of at least --pp-micro-batch-tokens tokens; None when the
        step runs whole (no pipeline, a single request, too few tokens, or --pp-micro-batches 1)."""
        if self.model.pipeline is None or len(items) < 2:
            return None
        tokens = [len(item.input_ids) for item in items]
        k = min(self.config.resolved_pp_micro_batches, sum(tokens) // self.config.pp_micro_batch_tokens)
        return split_by_request(tokens, k) if k > 1 else None

    def _pipelined(self, items: list, reqs: list, parts: list[range], input_ids: torch.Tensor,
                   wanted: list[int]) -> torch.Tensor:
        """The step as micro-batches in flight through the pipeline's stages (StageForward.run):
        each its own requests' layout and attention metadata, built just before its turn (the
        backend holds one at a time), its slice of input_ids [T] and of the wanted token indices
        (ascending) → the logits of every wanted index, in order."""
        ends = [0, *itertools.accumulate(len(item.input_ids) for item in items)]
        micro = []
        for part in parts:
            lo, hi = ends[part.start], ends[part.stop]
            rows = [w - lo for w in wanted if lo <= w < hi]

            def build(part=part, lo=lo, hi=hi, rows=rows):
                layout = self._layout(items[part.start:part.stop], reqs[part.start:part.stop])
                indices, = to_device([torch.tensor(rows, dtype=torch.int64)], self.device)
                return input_ids[lo:hi], self.forward_meta(layout.positions), indices
            micro.append(MicroBatch(hi - lo, len(rows), build))
        return self.model.pipeline.run(micro)

    def _layout(self, items: list, reqs: list, trees: dict[int, DraftTree] | None = None) -> BatchLayout:
        """The batch layout of these items (query lengths, positions, their rows of the page
        table; item index → the draft tree a verify item checks), prepared by the attention backend."""
        q_lens = [len(item.input_ids) for item in items]
        start = [item.start_pos for item in items]
        max_pages = -(-max(s + q for s, q in zip(start, q_lens)) // self.kv_spec.page_size)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64)
        # Built on the host from the host page table, then moved in one copy (host_to_device.py).
        layout = BatchLayout.build(q_lens, start, self.page_table[rows, :max_pages], self.kv_spec.page_size,
                                   trees or None)
        layout = layout.to(self.device)
        self.backend.prepare(layout, self.pool)
        return layout

    @torch.inference_mode()
    def prefill_logits(self, plan: StepPlan) -> torch.Tensor:
        """The accuracy harness's step (services/eval/perplexity.py): release and admit as execute()
        does, run every item op by op as a prefill chunk runs (its K/V written to the pool, earlier
        chunks' read back from it) → float32 logits [T, V] at every position of every item, in plan
        order. Samples nothing."""
        for rid in plan.released_rids:
            self._release(rid)
        for spec in plan.new_requests:
            self._admit(spec)
        reqs = [self.requests[item.rid] for item in plan.items]
        for req, item in zip(reqs, plan.items):
            self._append_pages(req, item.new_pages, item.reset_pages)
        input_ids, = to_device([torch.tensor([t for item in plan.items for t in item.input_ids],
                                             dtype=torch.int64)], self.device)
        if (parts := self._micro_batches(plan.items)) is not None:
            return self._pipelined(plan.items, reqs, parts, input_ids, list(range(input_ids.shape[0])))
        layout = self._layout(plan.items, reqs)
        meta = self.forward_meta(layout.positions)
        every = torch.arange(input_ids.shape[0], device=self.device)
        return self.model(input_ids, meta, every).float()

    def _one_call(self, plan: StepPlan, reqs: list[_Request], max_rows: int | None = None,
                  max_verify_rows: int | None = None) -> DecodeStep | None:
        """The step as a one-call decode step when it is one: decodes, and verify items as one
        row per position (row j of a verify item attends over its request's KV through position
        start + j: the stack writes every row's K/V before any row attends). None: op by op."""
        # The C++ stack computes the base model only (no LoRA hooks): a step with an adapter request,
        # its speculative verify items included, runs op by op, where the linears apply adapters.
        if any(req.adapter for req in reqs):
            return None
        if any(len(item.input_ids) > 1 and not item.verify for item in plan.items):  # a prefill chunk
            return None
        rows = sum(len(item.input_ids) for item in plan.items)
        verifying = rows > len(plan.items)
        limit = (self.verify_rows if max_verify_rows is None else max_verify_rows) if verifying else \
            (self.one_call_rows if max_rows is None else max_rows)
        if rows > limit:
            return None
        token_ids: list[int] = []
        positions: list[int] = []
        table_rows: list[int] = []
        logits_rows: list[int] = []
        for req, item in zip(reqs, plan.items):
            first = len(token_ids)
            token_ids += item.input_ids
            positions += range(item.start_pos, item.start_pos + len(item.input_ids))
            table_rows += [req.row] * len(item.input_ids)
            if item.sample:
                logits_rows += range(first, len(token_ids)) if item.verify else [len(token_ids) - 1]
        return DecodeStep(token_ids, positions, table_rows, logits_rows, self.page_table, self.kv_spec.page_size,
                          self.pool)

    def _computing(self) -> None:
        if self.on_compute is not None:
            self.on_compute()

    # --- weight updates (services/worker/weights): between steps, on the step thread --------
    weights_version: int = 0  # bumps by one with every successful update
    _weight_groups = None  # services.worker.weights.distributed.UpdateGroups, on the first join

    def update_weights_from_disk(self, path: str):
        """An HF safetensors directory or a GGUF file of the serving architecture → its
        WeightUpdateReport. Raises WeightUpdateError (a ValueError) with the old weights serving."""
        from services.worker.weights.updater import update_from_disk
        return update_from_disk(self, path)

    def update_weights_from_tensor(self, tensors=None, *, shm_path: str | None = None):
        """HF name → tensor in process, or shm_path: a safetensors file a trainer on this host wrote
        (services/common/weight_sync.write_shared_tensors) → WeightUpdateReport; WeightUpdateError."""
        from services.worker.weights.updater import update_from_tensor
        return update_from_tensor(self, tensors, shm_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "gloo", timeout_s: float = 60.0) -> None:
        """Join a trainer's (rank 0) torch.distributed group as rank rank_offset; blocks until every
        rank joined. Raises WeightUpdateError."""
        from services.worker.weights.distributed import UpdateGroups
        if self._weight_groups is None:
            self._weight_groups = UpdateGroups()
        self._weight_groups.join(master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s,
                                 self.device)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str):
        """Receive the tensors rank 0 broadcasts in group_name (HF names, dtype names, shapes, in
        broadcast order) → WeightUpdateReport; WeightUpdateError (a broken group is closed)."""
        from services.worker.weights.distributed import UpdateGroups
        from services.worker.weights.updater import update_from_distributed
        if self._weight_groups is None:
            self._weight_groups = UpdateGroups()
        return update_from_distributed(self, self._weight_groups, group_name, names, dtypes, shapes)

    def rebalance_experts(self) -> dict | None:
        """Plan an EPLB rebalance from the loads recorded since the last placement (--ep-size > 1;
        between two steps, on every rank of the group); its layers move over the next forward
        passes. Its record (imbalance before and expected, then seconds and weights moved as they
        move), or None when no token was recorded. ValueError without expert parallelism."""
        if self.expert_parallel is None:
            raise ValueError("rebalancing experts needs expert parallelism (--ep-size > 1)")
        return self.expert_parallel.rebalancer.plan()

    def destroy_weights_update_group(self, group_name: str) -> None:
        if self._weight_groups is not None:
            self._weight_groups.close(group_name)



def _rank_checkpoint(checkpoint: Checkpoint, part: RankPart) -> Checkpoint:
    """The checkpoint of a group's rank: the one its loader read as this part, or the whole one cut now."""
    if checkpoint.part is None:
        return replace(checkpoint, tensors=part.take(checkpoint.tensors), quantized=part.take(checkpoint.quantized),
                       part=part)
    if (checkpoint.part.rank, checkpoint.part.tp, checkpoint.part.pp) != (part.rank, part.tp, part.pp):
        raise ValueError(f"the checkpoint holds rank {checkpoint.part.rank}'s part of a TP {checkpoint.part.tp} x "
                         f"PP {checkpoint.part.pp} group; this runner is rank {part.rank} of TP {part.tp} x PP {part.pp}")
    return checkpoint


def _last_sampled(rid: str, req: _Request, start_pos: int) -> int:
    """The input of a decode planned before the scheduler knew it: the token this worker
    sampled for the request last (overlapped scheduling; services/scheduler/scheduler.py).
    While that token's step is deferred, a placeholder: the runner gathers it on the device."""
    generated = len(req.output_ids) + req.unapplied
    if not generated or start_pos != len(req.prompt_ids) + generated - 1:
        raise ValueError(f"request {rid}: LAST_SAMPLED at position {start_pos}, but the worker's last sampled "
                         f"token is at {len(req.prompt_ids) + generated - 1}")
    return 0 if req.unapplied else req.output_ids[-1]


def build_model(mc: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device, quantized: dict | None = None, quantization: str = "auto") -> LlamaForCausalLM:
    """Construct the registry's class for mc.architecture without random init (meta device),
    then load the checkpoint. quantization gguf / int8 / fp8: the linear weights (and a tied
    embedding) are held only quantized (services/worker/model/weight_format.py): gguf from
    `quantized`, the file's blocks (HF name → QuantWeight); int8 and fp8 from the loaded tensors."""
    from services.worker.model import weight_format
    with torch.device("meta"):
        model = model_class(mc)(mc)
    model = model.to_empty(device=device)
    kernel = weight_format.quant_kernel(quantization)
    if quantization == "gguf":  # before loading: the blocks' dense tensors need not be in `tensors`
        weight_format.apply_plan(model, weight_format.file_blocks_plan(model, quantized or {}), kernel)
    model.load_hf_tensors(tensors)
    if quantization in weight_format.REQUANTIZED:  # int8 / fp8: from the float32 values, before the cast
        weight_format.apply_plan(model, weight_format.requant_plan(model, quantization), kernel)
    model = model.to(dtype).eval()
    model.tie_lm_head()
    weight_format.tie_quantized_head(model, kernel)
    # The rope tables were never materialized on meta; they stay float32 in any dtype.
    model.rope = model.rope.__class__(mc).to(device)
    return model


def _with_context(mc: ModelConfig, n: int) -> ModelConfig:
    from dataclasses import replace
    return replace(mc, max_position_embeddings=min(n, mc.max_position_embeddings))


def default_threads() -> int:
    return os.cpu_count() or 1
