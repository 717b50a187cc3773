"""The scheduling loop's core: admission, batch formation, retraction, finishing.

Single-threaded and transport-free: `submit`/`abort` queue work, `schedule()`
returns the next StepPlan, `process(result)` applies the worker's answer and
yields per-request outputs. Each step carries every decoding request (one
token each) plus prefill chunks admitted against a token budget.

Overlapped scheduling: a driver may call `schedule()` again before the last
plan's result came back (services/scheduler/service.py keeps one plan queued
at the worker while another runs). Scheduling a step commits its progress at
once (`computed` counts the tokens of every step sent; `unsampled` the tokens
those steps sample), so the next plan continues where the sent ones end: a
chunked prefill goes on with its next chunk, and a decode whose input is still
being sampled gets `[LAST_SAMPLED]`, which the worker fills in. This is safe
because the worker runs plans in order: a page freed and handed out again
while a step is in flight is written by that step before the next plan's.
`process()` then applies results oldest first; a request that finished in the
meantime (EOS, abort, stop string) drops its token from the later step, a step
wasted on that row. Requests that end by length are not planned past their
last token.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, replace

from services.common.grammar.backend import GrammarBackend, create_backend as create_grammar_backend
from services.common.grammar.constraint import Constraint
from services.common.hicache_config import HiCacheConfig
from services.common.outputs import FinishReason, RequestOutput, TokenLogprob, TopToken, spec_counters
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.disaggregation import (
    DECODE, PREFILL, Attachment, AttachNeeded, DecodeRooms, DisaggregationConfig, PDSpec, PrefillRooms, RoomEvent,
    prompt_digest)
from services.scheduler.grammar_queue import GrammarQueue
from services.scheduler.hicache import PREFETCHING, PROBING, ExistsProbe, HiCache, StoreProbe
from services.scheduler.kv_manager import KVManager, new_radix_cache
from services.scheduler.page_keys import PageKeys
from services.scheduler.outputs import QueueFull, SchedulerStats
from services.scheduler.policy import order_waiting
from services.scheduler import prompt_outputs
from services.scheduler.request import Request, Status
from services.scheduler.speculation import SpeculationPolicy
from services.scheduler.step_costs import StepCosts
from services.step.contract import (
    LAST_SAMPLED, NewRequestSpec, SampledLogprobs, StepItem, StepPlan, StepResult, TokenRun)


@dataclass(frozen=True)
class ModelLimits:
    """What the scheduler must know about the worker's model and KV pool."""
    num_pages: int
    page_size: int
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # HiCache: the worker's host tier and what keys its pages in the kvstore.
    host_pages: int = 0
    page_bytes: int = 0  # one KV page, all layers, k and v
    model_identity: str = ""  # model name + a digest of its file (services/worker/host_pool.py)
    weights_version: str = "0"
    kv_layout: str = ""  # services/common/page_hash.kv_layout of the worker's pages
    max_draft_tokens: int = 0  # speculation: the most tokens the worker's drafter proposes (0: none)
    verify_max_rows: int = 0  # tokens of a step with verify items that the worker runs as one call (0: any)
    max_loras: int = 0  # distinct LoRA adapters one step may use (0: the worker serves none)


@dataclass
class _SentStep:
    """A plan sent to the worker whose result has not been processed yet."""
    plan: StepPlan
    runs: list[tuple[Request, int, bool]]  # (request, tokens it runs, whether it samples)


class Scheduler:
    def __init__(self, config: SchedulerConfig, limits: ModelLimits, hicache: HiCacheConfig | None = None,
                 store: ExistsProbe | StoreProbe | None = None, adapters: dict[str, str] | None = None,
                 disaggregation: DisaggregationConfig | None = None):
        """hicache/store: the tiers below the worker's pool (limits.host_pages > 0 turns
        the host tier on; `store` answers the kvstore's Exists). adapters: the LoRA adapters the
        worker has loaded, name → identity (set_adapters keeps it current). disaggregation: this
        replica's side of disaggregated pairs (None: co-located)."""
        self.config, self.limits = config, limits
        self.adapters: dict[str, str] = dict(adapters or {})
        # The adapters in the worker's slots, least recently used first: a mirror of its LRU
        # (services/worker/lora), reported to routers so they send an adapter's requests where it is.
        self.resident_adapters: OrderedDict[str, None] = OrderedDict()
        self.admission_paused = False  # a weight update is under way: nothing new starts
        self.stats = SchedulerStats(kv_pages_total=limits.num_pages)
        hicache = hicache or HiCacheConfig()
        if store is not None and not limits.model_identity:
            raise ValueError("a kvstore needs the worker's model identity to key pages")
        keys = PageKeys(limits.page_size, limits.model_identity, limits.weights_version, limits.kv_layout,
                        hicache.key_secret())
        cache = new_radix_cache(limits.num_pages, limits.page_size, config.disable_radix_cache, limits.host_pages,
                                write_back=store is not None and hicache.hicache_write_policy == "write_back",
                                keys_for=keys.node_keys)
        self.page_keys = keys
        self.hicache = HiCache(hicache, cache, keys, limits.page_bytes, store, self.stats)
        self.kv = KVManager(cache, should_load=self.hicache.should_load, on_cached=self.hicache.written)
        self.stats.host_pages_total = limits.host_pages if self.kv.host_allocator else 0
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        self.new_token_ratio = config.init_new_token_ratio
        self._aborts: set[str] = set()
        self.grammars = GrammarQueue(config.grammars_remembered)
        self._grammar_checker: GrammarBackend | None = None  # built on the first constraint (imports xgrammar)
        self._release: list[str] = []  # worker state to drop at the next step
        self._sent: deque[_SentStep] = deque()  # plans the worker has not answered yet, oldest first
        self._outputs: list[RequestOutput] = []
        self._step_id = 0
        self.spec = SpeculationPolicy(limits.max_draft_tokens, config.speculative_disable_batch_size,
                                      StepCosts(config.speculative_row_cost))
        self.accept_lengths: deque[int] = deque(maxlen=4096)  # tokens per speculative verify (telemetry drains)
        # Disaggregation (services/scheduler/disaggregation.py): one side of each pair, or neither.
        self.disaggregation = disaggregation or DisaggregationConfig()
        mode, timeout_s = self.disaggregation.disaggregation_mode, self.disaggregation.disaggregation_timeout_s
        self.prefill_rooms = PrefillRooms(limits.page_size, timeout_s) if mode == PREFILL else None
        self.decode_rooms = DecodeRooms() if mode == DECODE else None

    # --- intake -------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequest for input that can never be served."""
        lim = self.limits
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < lim.vocab_size)]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {lim.vocab_size})")
        sampling.validate(lim.vocab_size)
        if sampling.prompt_logprobs >= 0 and sampling.logprob_start_len >= len(prompt_ids):
            raise InvalidRequest(f"logprob_start_len ({sampling.logprob_start_len}) must be below the prompt's "
                                 f"length ({len(prompt_ids)} tokens)")
        if sampling.constraint is not None:
            if self._grammar_checker is None:
                self._grammar_checker = create_grammar_backend(self.config.grammar_checker)
            self._grammar_checker.check(sampling.constraint)
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > lim.context_length:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
                f"exceeds the model's context length of {lim.context_length} tokens")
        if self.kv.pages_for(total) > lim.num_pages:
            raise InvalidRequest(
                f"prompt + max_new_tokens = {total} tokens can never fit in the KV cache "
                f"({lim.num_pages * lim.page_size} tokens): lower max_tokens or raise --kv-cache-bytes")

    def submit(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, seed: int,
               namespace: str = "", adapter: str = "", pd: PDSpec | None = None) -> None:
        self.validate(prompt_ids, sampling)
        self._check_role(pd)
        namespace = self.cache_namespace(namespace, adapter)
        if rid in self.running or any(r.rid == rid for r in self.waiting) or self._in_rooms(rid):
            raise InvalidRequest(f"request id {rid!r} is already in use")
        self.check_capacity(len(prompt_ids))
        req = Request(rid, list(prompt_ids), sampling, seed, namespace, adapter, pd=pd)
        if self.prefill_rooms is not None:
            self.prefill_rooms.open(req, pd.room, time.monotonic())
        if sampling.constraint is not None and not self.grammars.is_ready(sampling.constraint):
            self.grammars.hold(req)  # until the worker compiled its grammar: grammar_prepared()
        else:
            self._queue(req)

    def _queue(self, req: Request) -> None:
        """Into the waiting queue, or on a decode side into the queue for pages (schedule() reserves
        them, then the prefill side's KV fills them)."""
        (self.decode_rooms.incoming if self.decode_rooms is not None else self.waiting).append(req)

    def _check_role(self, pd: PDSpec | None) -> None:
        """A request's part in a pair must be this replica's (--disaggregation-mode)."""
        mode = self.disaggregation.disaggregation_mode
        role = pd.role if pd is not None else "null"
        if role != mode:
            if mode == "null":
                raise InvalidRequest(f"this replica is not disaggregated: it takes no {role} side of a pair")
            raise InvalidRequest(f"this replica is the {mode} side of disaggregated pairs: send requests through "
                                 f"a router with --prefill and --decode replicas (got {role})")
        if pd is not None and not pd.room:
            raise InvalidRequest("disaggregation.room is required")
        if role == DECODE and not pd.bootstrap_address:
            raise InvalidRequest("disaggregation.bootstrap_address is required on the decode side")

    def _in_rooms(self, rid: str) -> bool:
        if self.decode_rooms is not None:
            d = self.decode_rooms
            return rid in d.receiving or any(r.rid == rid for r in d.incoming)
        return self.prefill_rooms is not None and rid in self.prefill_rooms.held

    def cache_namespace(self, namespace: str, adapter: str) -> str:
        """The prefix-cache (and kvstore) namespace of a request: the tenant's, plus the adapter's
        identity (its name and a digest of its weights), so no prefix is shared across adapters or
        with the base model. Raises InvalidRequest for an adapter the worker has not loaded."""
        if not adapter:
            return namespace
        identity = self.adapters.get(adapter)
        if identity is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequest(f"unknown LoRA adapter {adapter!r} (loaded: {loaded})")
        return f"{namespace}/lora:{identity}" if namespace else f"lora:{identity}"

    def set_adapters(self, adapters: dict[str, str]) -> None:
        """The worker's loaded adapters changed (name → identity)."""
        self.adapters = dict(adapters)
        for name in [n for n in self.resident_adapters if n not in adapters]:
            del self.resident_adapters[name]

    def adapter_users(self, name: str) -> int:
        """Requests queued or running under adapter `name`."""
        return sum(r.adapter == name for r in (*self.waiting, *self.running.values(), *self.grammars.held()))

    def retract_all(self) -> int:
        """Send every running request back to the queue (its KV stays cached until a flush);
        they re-run from their prompt and outputs when admitted again. Returns how many."""
        ratio, running = self.new_token_ratio, list(self.running.values())
        for req in running:
            self._retract(req)
        self.new_token_ratio = ratio  # not a sign of an optimistic reservation
        return len(running)

    def weights_updated(self, version: str) -> int:
        """The worker swapped its weights: drop every cached page (both tiers) and key pages by
        the new version, so nothing computed under the old weights is ever read again (the
        kvstore's old pages stop matching). Needs no request running and no step in flight.
        Returns the pages dropped."""
        if self.running or self._sent:
            raise RuntimeError("weights_updated() while requests run or steps are in flight")
        cache = self.kv.cache
        dropped = cache.cached_pages + cache.host_pages
        cache.reset()
        self.limits = replace(self.limits, weights_version=version)
        self.page_keys.set_weights_version(version)
        for req in self.waiting:  # keys and store answers computed under the old version
            req.page_keys, req.store_pages, req.store_state = [], 0, ""
        self._refresh_gauges()
        return dropped

    def take_grammar_jobs(self) -> list[Constraint]:
        """Constraints the worker should compile (each asked for once) before their requests are admitted."""
        return self.grammars.take_jobs()

    def grammar_prepared(self, key: str, error: str | None = None) -> None:
        """The worker compiled grammar `key` (or failed: its requests end with `error`)."""
        for req in self.grammars.prepared(key, error is None):
            if error is None:
                self._queue(req)
            else:
                req.status = Status.FINISHED
                self._close_room(req, error)
                self.stats.finished += 1
                self._outputs.append(RequestOutput(req.rid, finished=True, finish_reason=FinishReason.ERROR,
                                                   prompt_tokens=len(req.prompt_ids), error=error))

    def check_capacity(self, prompt_len: int) -> None:
        queued_requests = len(self.waiting) + len(self.grammars)
        if queued_requests >= self.config.max_queued_requests:
            raise QueueFull(f"{queued_requests} requests are waiting (limit {self.config.max_queued_requests})")
        queued = sum(r.seq_len for r in self.waiting)
        if queued + prompt_len > self.config.max_queued_tokens:
            raise QueueFull(f"{queued} prompt tokens are waiting (limit {self.config.max_queued_tokens})")

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    @property
    def has_work(self) -> bool:
        """Something to plan. A room waiting for the other side is not: its event wakes the loop."""
        return bool(self.waiting or self.running or self._aborts or self._release or len(self.grammars)
                    or (self.decode_rooms is not None and self.decode_rooms.incoming)
                    or (self.prefill_rooms is not None and self.prefill_rooms.can_send()))

    @property
    def steps_in_flight(self) -> int:
        """Plans returned by schedule() whose results process() has not applied yet."""
        return len(self._sent)

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # --- one step -------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when there is nothing to run."""
        t0 = time.perf_counter()
        self._apply_aborts()
        items: list[StepItem] = []
        scheduled: list[Request] = []
        self._schedule_decodes(items, scheduled)
        if self.decode_rooms is not None:
            self._preallocate()
        else:
            self._schedule_prefills(items, scheduled)
        self._set_draft_depths(items, scheduled)
        self._touch_adapters(scheduled)
        if not items and self.running and not self.waiting and not self._sent:
            # Nothing can grow: free memory by retracting the least advanced request.
            victim = self._pick_victim()
            if victim is not None:
                self._retract(victim)
        plan = None
        rooms = self.prefill_rooms
        if rooms is not None:
            self._expire_rooms(rooms)
        if items or self._release or self.hicache.take_copies(None) or (rooms is not None and rooms.can_send()):
            self._step_id += 1
            plan = StepPlan(self._step_id)
            self.hicache.take_copies(plan)
            for req in scheduled:
                if not req.worker_has_state:
                    plan.new_requests.append(NewRequestSpec(
                        req.rid, req.prompt_ids, list(req.output_ids), req.sampling, req.seed, req.adapter))
                    req.worker_has_state = True
            # A request retracted and re-admitted within this step: its new spec
            # replaces the worker's old state, which must not be dropped after it.
            readmitted = {spec.rid for spec in plan.new_requests}
            plan.released_rids = [rid for rid in self._release if rid not in readmitted]
            self._release = []
            plan.items = items
            self._sent.append(_SentStep(plan, self._commit(scheduled, items)))
            if rooms is not None:
                rooms.add_sends(plan)  # the pages this plan (and those before it) complete
        self._refresh_gauges()
        self.stats.schedule_seconds += time.perf_counter() - t0
        return plan

    def _touch_adapters(self, scheduled: list[Request]) -> None:
        """Mirror the worker's slot LRU: the step's adapters become the most recently used."""
        lru = self.resident_adapters
        for name in dict.fromkeys(r.adapter for r in scheduled if r.adapter):
            lru[name] = None
            lru.move_to_end(name)
        while len(lru) > self.limits.max_loras:
            lru.popitem(last=False)

    def _adapter_fits(self, req: Request) -> bool:
        """Every running request runs in every step, so the running adapters must fit the
        worker's slots: a new adapter waits while max_loras others are running."""
        if not req.adapter:
            return True
        running = {r.adapter for r in self.running.values() if r.adapter}
        return req.adapter in running or len(running) < self.limits.max_loras

    def _item(self, req: Request, n: int) -> StepItem:
        start = req.computed
        reset = req.pages_changed
        new_pages = req.pages if reset else req.pages[req.sent_pages:]
        req.sent_pages = len(req.pages)
        req.pages_changed = False
        if req.last_token_pending:  # a decode planned before its input token came back
            assert n == 1, f"{req.rid}: only a decode can run a token still being sampled"
            item = StepItem(req.rid, [LAST_SAMPLED], start, list(new_pages), reset)
        else:
            item = StepItem(req.rid, req.tokens(start, n), start, list(new_pages), reset,
                            sample=start + n == req.seq_len and req.sampling.max_new_tokens > 0)
        return item

    def _set_draft_depths(self, items: list[StepItem], scheduled: list[Request]) -> None:
        """Speculation: how many tokens the worker drafts after each sampled item, for the batch
        as it runs after this step's admissions."""
        if self.limits.max_draft_tokens <= 0:
            return
        batch = len(self.running)
        for item, req in zip(items, scheduled):
            if item.sample and self.prefill_rooms is None:  # a prefill side samples one token: no draft
                item.draft_depth = self.spec.depth(req, batch)

    def _verify_item(self, req: Request) -> StepItem:
        """[last token, *draft]: the worker keeps what its sampling agrees with (jump-forward's
        forced tokens, or a speculative draft)."""
        item = self._item(req, 1)
        item.input_ids = item.input_ids + req.draft
        item.verify, req.draft = True, []
        req.verifying_speculative = req.draft_speculative
        return item

    @staticmethod
    def _commit(scheduled: list[Request], items: list[StepItem]) -> list[tuple[Request, int, bool]]:
        """Count a planned step as done: the next plan continues after it."""
        runs = []
        for req, item in zip(scheduled, items):
            n = len(item.input_ids)
            req.computed += n
            req.unsampled += item.sample
            runs.append((req, n, item.sample))
        return runs

    def _ends_in_flight(self, req: Request) -> bool:
        """A step in flight samples its last token (by length, or the prefill side's only one):
        plan nothing more for it."""
        if not req.unsampled:
            return False
        if self.prefill_rooms is not None:
            return True
        n_out = len(req.output_ids) + req.unsampled
        return n_out >= req.sampling.max_new_tokens or req.seq_len + req.unsampled >= self.limits.context_length

    def _schedule_decodes(self, items: list[StepItem], scheduled: list[Request]) -> None:
        decoding = [r for r in self.running.values() if r.pending == 1 and not self._ends_in_flight(r)
                    and not (r.jumping and r.unsampled)]  # a jump-forward waits for its step in flight
        self._fit_drafts(decoding)
        need = sum(max(self.kv.pages_for(r.computed + 1 + len(r.draft)) - len(r.pages), 0) for r in decoding)
        while need > self.kv.available_pages:
            victim = self._pick_victim()
            if victim is None:
                break
            if victim in decoding:
                decoding.remove(victim)
                need -= max(self.kv.pages_for(victim.computed + 1 + len(victim.draft)) - len(victim.pages), 0)
            self._retract(victim)
        for req in decoding:
            n = 1 + len(req.draft)
            if not self.kv.grow(req, req.computed + n):  # cannot happen after the loop above
                raise RuntimeError(f"KV accounting error: no page for decoding request {req.rid}")
            items.append(self._item(req, 1) if not req.draft else self._verify_item(req))
            scheduled.append(req)

    def _fit_drafts(self, decoding: list[Request]) -> None:
        """Trim drafts so the step's tokens stay within what the worker runs as one call (its
        verify_max_rows): a longer step would run op by op, slower, and in a reduced dtype
        with logits that depend on the batch."""
        if self.limits.verify_max_rows <= 0:
            return
        spare = self.limits.verify_max_rows - len(decoding)
        for req in decoding:
            if req.draft:
                req.draft = req.draft[:max(spare, 0)]
                spare -= len(req.draft)

    def _pick_victim(self) -> Request | None:
        """Least progress first (fewest outputs, then the latest arrival), keeping one."""
        if len(self.running) <= 1:
            return None
        return min(self.running.values(), key=lambda r: (len(r.output_ids), -r.arrival_time))

    def _retract(self, req: Request) -> None:
        self.kv.release(req)  # its KV stays cached (evictable) for the recompute
        del self.running[req.rid]
        req.status, req.worker_has_state = Status.WAITING, False
        req.retractions += 1
        self._release.append(req.rid)
        self.waiting.append(req)
        self.stats.retracted += 1
        # Retraction means the reservation was too optimistic: reserve more.
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)

    def _reserved_pages(self) -> int:
        """KV to keep back for the expected decode growth of running requests."""
        total = 0
        for r in self.running.values():
            expected = r.seq_len + int(r.remaining_new_tokens * self.new_token_ratio)
            total += max(self.kv.pages_for(expected) - len(r.pages), 0)
        return total

    def _schedule_prefills(self, items: list[StepItem], scheduled: list[Request]) -> None:
        budget = self.config.prefill_budget
        for req in [r for r in self.running.values() if r.pending > 1]:  # chunked ones continue
            room = (len(req.pages) + self.kv.available_pages) * self.kv.page_size - req.computed
            n = min(req.pending, budget, room)
            if n <= 0 or not self.kv.grow(req, req.computed + n):
                continue
            items.append(self._item(req, n))
            scheduled.append(req)
            budget -= n
        for req in self.waiting:  # the store's answer (and a prefetch) while it waits; never blocks
            if req.store_state in ("", PROBING) and not req.unsampled:
                self.hicache.probe(req)
        if not self.waiting or budget <= 0 or self.admission_paused:
            return
        cache = self.kv.cache if self.kv.cache_enabled else None
        ordered = order_waiting(self.waiting, self.config.schedule_policy, cache,
                                self.config.lpm_fallback_queue_len)
        reserved = self._reserved_pages()
        admitted: list[Request] = []
        for req in ordered:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            n = self._admit(req, budget, reserved, first=not items)
            if n == 0:
                if self._blocked_by_memory:
                    break
                continue
            budget -= n
            reserved += self._own_reservation(req)
            admitted.append(req)
            items.append(self._item(req, n))
            scheduled.append(req)
        if admitted:
            gone = set(map(id, admitted))
            self.waiting = [r for r in self.waiting if id(r) not in gone]
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)

    # --- admission helpers ------------------------------------------------------------
    _blocked_by_memory = False

    def _admit(self, req: Request, budget: int, reserved: int, first: bool) -> int:
        """Try to start (or restart) req with up to `budget` prefill tokens.
        Returns the tokens scheduled, 0 when it must wait."""
        self._blocked_by_memory = False
        if req.unsampled:
            return 0  # retracted while a step in flight samples its next token: admit it once known
        if req.store_state in (PROBING, PREFETCHING):
            return 0  # the store's answer, or its prefix from the store, is on its way: admit it once in
        if self._shares_inflight_prefill(req):
            return 0  # its prefix is being computed right now: reuse it next step
        if not self._adapter_fits(req):
            return 0  # max_loras other adapters are running: wait for one to finish
        matched = self.kv.match(req, prompt_outputs.reuse_limit(req))
        n = min(req.pending, budget)
        if n < req.pending and self.config.chunked_prefill_size < 0:
            if not first:
                self.kv.release(req)
                return 0
            n = req.pending  # chunking off: a long prompt runs whole, alone
        need = self.kv.pages_for(req.computed + n) - len(req.pages)
        if n == req.pending:
            need += self._own_reservation(req, extra_tokens=0)
        if need > self.kv.available_pages - reserved:
            self.kv.release(req)
            self._blocked_by_memory = True
            return 0
        if not self.kv.grow(req, req.computed + n):
            self.kv.release(req)
            self._blocked_by_memory = True
            return 0
        self._count_prefix_query(req.seq_len, matched)
        if req.retractions == 0:
            req.cached_tokens = matched
            req.admit_time = time.monotonic()
        req.status = Status.RUNNING
        self.running[req.rid] = req
        return n

    def _count_prefix_query(self, tokens: int, matched: int) -> None:
        s = self.stats
        s.prefix_queries, s.prefix_query_tokens = s.prefix_queries + 1, s.prefix_query_tokens + tokens
        s.prefix_hit_tokens, s.prefix_hits = s.prefix_hit_tokens + matched, s.prefix_hits + (matched > 0)

    def _own_reservation(self, req: Request, extra_tokens: int = 0) -> int:
        expected = req.seq_len + extra_tokens + int(req.remaining_new_tokens * self.new_token_ratio)
        return max(self.kv.pages_for(expected) - max(len(req.pages), self.kv.pages_for(req.seq_len)), 0)

    def _shares_inflight_prefill(self, req: Request) -> bool:
        """True when a request now prefilling will soon cache a long prefix of req:
        waiting a step or two beats computing the same prefix twice. What the tree
        holds counts (`tree_tokens`), not what is planned: a chunk in flight is
        cached when its result is processed."""
        if not self.kv.cache_enabled:
            return False
        min_gain = max(64, self.limits.page_size)
        for other in self.running.values():
            if other.namespace != req.namespace or other.tree_tokens + min_gain > len(other.prompt_ids):
                continue
            common = common_prefix_len(req.prompt_ids, other.prompt_ids)
            if common - other.tree_tokens >= min_gain:
                return True
        return False

    # --- applying the worker's answer -------------------------------------------------------
    def process(self, result: StepResult) -> list[RequestOutput]:
        """Apply the result of the oldest step in flight."""
        if not self._sent:
            raise RuntimeError(f"result of step {result.step_id} arrived, but no step is in flight")
        sent = self._sent.popleft()
        plan = sent.plan
        if result.step_id != plan.step_id:
            raise RuntimeError(f"result of step {result.step_id} arrived, step {plan.step_id} was expected")
        self.hicache.completed(plan.kv_copies, result.kv_transfers)
        self.hicache.observe_step(plan, result.forward_seconds, result.kv_transfers)
        if self.prefill_rooms is not None:
            for req, error in self.prefill_rooms.sent(result.kv_sends):
                self._end_room_request(req, error)
        none = [None] * len(result.rids)
        sampled = {rid: row for rid, *row in zip(result.rids, result.next_token_ids, result.logprobs or none,
                                                 result.accepted or none, result.drafts or none)}
        now = time.monotonic()
        speculated = False
        extras = result.prompt_logprobs or result.embeddings  # prompt_outputs.py: only when some request asked
        for (req, n, samples), item in zip(sent.runs, plan.items):
            if req.status is Status.FINISHED:  # ended while the step ran: its token is dropped
                continue
            if extras:
                prompt_outputs.collect(req, [p for p in result.prompt_logprobs if p.rid == req.rid],
                                       next((e for e in result.embeddings if e.rid == req.rid), None))
            if samples:
                if req.rid not in sampled:
                    raise RuntimeError(f"step {plan.step_id}: the worker sampled no token for {req.rid}")
                tok, lp, more, draft = sampled[req.rid]
                if req.pd is not None and self.prefill_rooms is not None:
                    self._prefill_sampled(req, tok, lp, now)
                    continue
                tokens = [tok] + (more.ids if more is not None else [])
                if item.verify:
                    speculated |= self._verified(req, n, tokens)
                self._take_token(req, tokens, lp, now)
                self._note_draft(req, draft)
            if n > 1 and req.status is Status.RUNNING:
                self.kv.cache_progress(req)
            if not samples and req.sampling.max_new_tokens == 0 and req.status is Status.RUNNING \
                    and item.start_pos + n >= req.seq_len:
                self._prefilled(req)
        self.stats.steps += 1
        self.stats.draft_seconds += result.draft_seconds
        self._observe_costs(plan, result)
        if speculated:
            self.stats.spec_steps += 1
            self.stats.verify_seconds += result.forward_seconds
        self._refresh_gauges()
        return self.take_outputs()

    def _observe_costs(self, plan: StepPlan, result: StepResult) -> None:
        """A decode step's time is a price for speculation (step_costs.py); prefills and KV moves
        are not."""
        if (self.config.speculative_cost_model != "measured" or self.limits.max_draft_tokens <= 0 or plan.kv_copies
                or plan.kv_sends or not plan.items):
            return
        if any(len(it.input_ids) > 1 and not it.verify for it in plan.items):
            return
        self.spec.costs.observe_step(sum(len(it.input_ids) for it in plan.items), result.forward_seconds,
                                     result.draft_seconds, sum(it.draft_depth for it in plan.items))

    def _verified(self, req: Request, n: int, tokens: list[int]) -> bool:
        """A verify item of n tokens ([last, *draft]) produced `tokens`: the draft after the first
        disagreement has no valid KV, and pages it alone needed go back to the pool (the radix
        cache and the kvstore only ever see accepted tokens). True for a speculative draft."""
        if req.status is Status.RUNNING:
            req.computed -= n - len(tokens)
            self.kv.shrink(req, req.computed)
        if not req.verifying_speculative:
            return False
        req.verifying_speculative = False
        drafted, accepted = n - 1, len(tokens) - 1
        req.spec_verify_steps += 1
        req.spec_draft_tokens += drafted
        req.spec_accepted_tokens += accepted
        s = self.stats
        s.spec_verify_items, s.spec_draft_tokens, s.spec_accepted_tokens = (
            s.spec_verify_items + 1, s.spec_draft_tokens + drafted, s.spec_accepted_tokens + accepted)
        self.accept_lengths.append(len(tokens))
        self.spec.verified(req, drafted, accepted)
        return True

    def _take_token(self, req: Request, tokens: list[int], lp, now: float) -> None:
        """A row's tokens (one sampled; more from a verify item: jump-forward): append them, stream
        them, and end the request if one says so. The request may have been retracted since the
        step was planned: it keeps the tokens for its recompute."""
        req.unsampled -= 1
        taken, reason, matched = [], None, None
        for tok in tokens:
            req.output_ids.append(tok)
            taken.append(tok)
            reason, matched = self._finish_reason(req, tok)
            if reason:
                break
        self.stats.jump_forward_tokens += len(taken) - 1
        if req.first_token_time is None:
            req.first_token_time = now
        logprobs = [] if lp is None else [token_logprob(tokens[0], lp)]
        out = RequestOutput(req.rid, taken, logprobs, prompt_tokens=len(req.prompt_ids),
                            completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
                            **spec_counters(req))
        if not req.extras_sent and (req.sampling.prompt_logprobs >= 0 or req.sampling.embed):
            prompt_outputs.attach(req, out)
        if reason:
            self._finish(req, reason, matched, out)
        self._outputs.append(out)

    def _prefilled(self, req: Request) -> None:
        """A request of max_new_tokens 0 ran its whole prompt: it ends (its prompt cached like any
        finished request's) with what it asked for, no tokens."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        out = RequestOutput(req.rid, prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)
        prompt_outputs.attach(req, out)
        self._finish(req, FinishReason.LENGTH, None, out)
        self._outputs.append(out)

    def _more_in_flight(self, req: Request) -> bool:
        """A step still in flight (after the one being processed) samples for req."""
        return any(r is req and samples for step in self._sent for r, _, samples in step.runs)

    def _note_draft(self, req: Request, run: TokenRun | None) -> None:
        """A draft (jump-forward's or speculation's) is planned as a verify item once nothing is
        in flight for req (overlapped scheduling: a step planned ahead is waited out, its own
        draft used instead)."""
        draft = run.ids if run is not None else []
        if not draft or req.status is not Status.RUNNING:  # the common case: no scan of the steps in flight
            req.draft, req.jumping = [], False
            return
        stale = self._more_in_flight(req)
        room = min(req.remaining_new_tokens, self.limits.context_length - req.seq_len) - 1
        req.draft = [] if stale else draft[:max(room, 0)]
        req.jumping, req.draft_speculative = bool(draft), run.speculative

    def step_failed(self) -> StepPlan | None:
        """The oldest step in flight will never be answered (the worker failed it): undo
        what planning it committed, so that ending its requests caches none of its KV.
        Returns its plan (None when nothing was in flight)."""
        if not self._sent:
            return None
        sent = self._sent.popleft()
        self.hicache.completed(sent.plan.kv_copies, None)
        if self.prefill_rooms is not None:
            self.prefill_rooms.unplan(sent.plan)
        for req, n, samples in sent.runs:
            if req.status is Status.RUNNING:
                req.computed -= n
            req.unsampled -= samples
        return sent.plan

    def _finish_reason(self, req: Request, tok: int) -> tuple[FinishReason | None, int | None]:
        sp, n_out = req.sampling, len(req.output_ids)
        if n_out >= sp.min_new_tokens:
            if tok in sp.stop_token_ids:
                return FinishReason.STOP, tok
            if not sp.ignore_eos and tok in self.limits.eos_token_ids:
                return FinishReason.STOP, tok
        if n_out >= sp.max_new_tokens or req.seq_len >= self.limits.context_length:
            return FinishReason.LENGTH, None
        return None, None

    def finish_early(self, rid: str, reason: FinishReason = FinishReason.STOP, matched: str | None = None) -> None:
        """End a request for a reason found outside (a stop string): a running one finishes now,
        one still queued (or retracted) is dropped like an abort. Unknown rids are ignored."""
        req = self.running.get(rid)
        if req is not None:
            self._finish(req, reason, matched, None)
        else:
            self.abort(rid)

    def _finish(self, req: Request, reason: FinishReason, matched, out: RequestOutput | None) -> None:
        if req.status is Status.WAITING:  # retracted (holds no KV) while its last token was sampled
            self.waiting.remove(req)
        else:
            self.kv.release(req)
            self.running.pop(req.rid, None)
        req.status, req.finish_reason, req.matched_stop = Status.FINISHED, reason, matched
        req.unsampled = 0
        if req.pd is not None and self.prefill_rooms is not None:
            self.prefill_rooms.finished(req, None if reason is FinishReason.LENGTH else
                                        f"the prefill side ended the request ({reason.value})")
        self.spec.forget(req.rid)
        if req.worker_has_state:
            self._release.append(req.rid)
        if reason is FinishReason.ABORT:
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        if out is not None:
            out.finished, out.finish_reason, out.matched_stop = True, reason, matched

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, set()
        self._abort_rooms(aborts)
        queued = self.waiting + (self.decode_rooms.incoming if self.decode_rooms is not None else [])
        for req in self.grammars.remove(aborts) + [r for r in queued if r.rid in aborts]:
            if req in self.waiting:  # else it waited for its grammar, or for pages on a decode side
                self.waiting.remove(req)
            elif self.decode_rooms is not None and req in self.decode_rooms.incoming:
                self.decode_rooms.incoming.remove(req)
            self._close_room(req, "the prefill side's request was aborted")
            req.status = Status.FINISHED
            self.spec.forget(req.rid)  # retracted after it speculated: its acceptance rate too
            self.stats.aborted += 1
            self._outputs.append(self._abort_output(req))
        for rid in aborts & self.running.keys():
            req = self.running[rid]
            out = self._abort_output(req)
            self._finish(req, FinishReason.ABORT, None, out)
            self._outputs.append(out)

    # --- disaggregation: the prefill side ------------------------------------------------
    def attach_room(self, room: str, attachment: Attachment) -> None:
        """The decode side of `room` attached (its pages and transfer descriptor). Raises
        InvalidRequest when it does not fit the room's request."""
        self.prefill_rooms.attach(room, attachment, time.monotonic())

    def detach_room(self, room: str) -> None:
        """The decode side went away: its request ends here and frees its pages."""
        req = self.prefill_rooms.detach(room)
        if req is not None:
            self.abort(req.rid)

    def take_room_events(self) -> list[RoomEvent]:
        return self.prefill_rooms.take_events() if self.prefill_rooms is not None else []

    def _prefill_sampled(self, req: Request, token: int, lp, now: float) -> None:
        """The prompt's first token: the decode side's once every page is across. Until then
        the request holds its pages outside the running batch."""
        req.unsampled -= 1
        req.first_token_time = req.first_token_time or now
        if req.status is not Status.RUNNING:  # retracted meanwhile: its recompute samples again
            return
        logprob = None if lp is None else token_logprob(token, lp)
        self.prefill_rooms.sampled(req, token, logprob)
        del self.running[req.rid]
        self.prefill_rooms.held[req.rid] = req
        self._finish_room_if_complete(req)

    def _finish_room_if_complete(self, req: Request) -> None:
        if not self.prefill_rooms.complete(req):
            return
        token, logprob = self.prefill_rooms.rooms[req.pd.room].first
        req.output_ids.append(token)
        out = RequestOutput(req.rid, [token], [logprob] if logprob else [], prompt_tokens=len(req.prompt_ids),
                            completion_tokens=1, cached_tokens=req.cached_tokens)
        self._finish(req, FinishReason.LENGTH, None, out)
        self._outputs.append(out)

    def _end_room_request(self, req: Request, error: str) -> None:
        """A room failed on this side: the request ends with `error`, its pages freed."""
        if req.status is Status.FINISHED:
            return
        self.prefill_rooms.finished(req, error)
        out = RequestOutput(req.rid, finished=True, finish_reason=FinishReason.ERROR,
                            prompt_tokens=len(req.prompt_ids), error=error)
        self._finish(req, FinishReason.ERROR, None, None)
        self._outputs.append(out)

    def _close_room(self, req: Request, error: str) -> None:
        """A prefill-side request that ended before it ran: its room says why."""
        if req.pd is not None and self.prefill_rooms is not None:
            self.prefill_rooms.finished(req, error)

    def _expire_rooms(self, rooms: PrefillRooms) -> None:
        for req in rooms.expired(time.monotonic()):
            self._end_room_request(req, f"no decode side attached to room {req.pd.room!r} within "
                                        f"{rooms.timeout_s:g}s")
        for req in [r for r in list(rooms.held.values()) if rooms.complete(r)]:
            self._finish_room_if_complete(req)

    def _abort_rooms(self, aborts: set[str]) -> None:
        """Aborted requests holding a room's pages outside the running batch."""
        held = self.prefill_rooms.held if self.prefill_rooms is not None else {}
        for rid in aborts & held.keys():
            req = held[rid]
            out = self._abort_output(req)
            self._finish(req, FinishReason.ABORT, None, out)
            self._outputs.append(out)
        receiving = self.decode_rooms.receiving if self.decode_rooms is not None else {}
        for rid in aborts & receiving.keys():
            self._drop_received(receiving.pop(rid), None)

    # --- disaggregation: the decode side -------------------------------------------------
    def take_attach_needed(self) -> list[AttachNeeded]:
        return self.decode_rooms.take_attach_needed() if self.decode_rooms is not None else []

    def _preallocate(self) -> None:
        """Reserve pages for queued requests' prompts (after matching this side's own cache), so
        the prefill side can write into them; first come, first served."""
        rooms = self.decode_rooms
        reserved = self._reserved_pages()
        while rooms.incoming and len(self.running) + len(rooms.receiving) < self.config.max_running_requests:
            req = rooms.incoming[0]
            if not self._adapter_fits(req):
                break
            matched = self.kv.match(req)
            prompt = len(req.prompt_ids)
            need = self.kv.pages_for(prompt) - len(req.pages) + self._own_reservation(req)
            if need > self.kv.available_pages - reserved or not self.kv.grow(req, prompt):
                self.kv.release(req)
                break
            rooms.incoming.pop(0)
            reserved += self._own_reservation(req)
            req.status, req.cached_tokens = Status.RUNNING, matched
            rooms.receiving[req.rid] = req
            first = matched // self.kv.page_size
            rooms.attach_needed.append(AttachNeeded(req.rid, req.pd.room, req.pd.bootstrap_address,
                                                    list(req.pages[first:]), matched, prompt,
                                                    prompt_digest(req.prompt_ids)))
            self._count_prefix_query(prompt, matched)

    def kv_arrived(self, rid: str, token: int, logprob: TokenLogprob | None, prefill_cached: int) -> None:
        """The prefill side's Done: the prompt's KV is in the reserved pages and `token` is the
        first output. The request decodes from here. Unknown rids (aborted meanwhile) are ignored."""
        req = self.decode_rooms.receiving.pop(rid, None)
        if req is None:
            return
        prompt = len(req.prompt_ids)
        req.computed, req.cached_tokens = prompt, min(prefill_cached, prompt)
        req.admit_time = time.monotonic()
        self.running[rid] = req
        req.unsampled = 1
        lp = None if logprob is None else SampledLogprobs(logprob.logprob, [(t.token_id, t.logprob) for t in logprob.top])
        self._take_token(req, [token], lp, time.monotonic())
        if req.status is Status.RUNNING:
            self.kv.cache_progress(req)  # the prompt's pages serve later requests on this side

    def kv_failed(self, rid: str, error: str) -> None:
        """The KV will not come (the prefill side failed, timed out or went away): the request
        ends with `error` and its reserved pages go back, none of them into the tree."""
        req = self.decode_rooms.receiving.pop(rid, None) if self.decode_rooms is not None else None
        if req is None:
            return
        out = RequestOutput(rid, finished=True, finish_reason=FinishReason.ERROR,
                            prompt_tokens=len(req.prompt_ids), error=error)
        self._drop_received(req, out)

    def _drop_received(self, req: Request, out: RequestOutput | None) -> None:
        req.computed = req.tree_tokens  # only the matched prefix is known KV
        self.kv.release(req)
        req.status = Status.FINISHED
        self.stats.aborted += 1
        self._outputs.append(out if out is not None else self._abort_output(req))

    @staticmethod
    def _abort_output(req: Request) -> RequestOutput:
        return RequestOutput(req.rid, finished=True, finish_reason=FinishReason.ABORT, prompt_tokens=len(req.prompt_ids),
                             completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
                             **spec_counters(req))

    def _refresh_gauges(self) -> None:
        s = self.stats
        s.running, s.waiting = len(self.running), len(self.waiting)
        s.kv_pages_used = self.kv.num_pages - self.kv.allocator.num_free
        s.kv_pages_cached = self.kv.cache.cached_pages
        s.host_pages_cached = self.kv.cache.host_pages
        s.host_hit_tokens = self.kv.host_hit_tokens
        c = self.kv.cache.counters
        s.pages_demoted = c["demoted"]
        s.pages_dropped = c["dropped_host"] + c["dropped_device"]
        if self.kv.cache.write_back:
            s.pages_written_to_store = c["written_back"]

    def flush_cache(self) -> bool:
        """Drop every cached prefix (after a weight update, say). False, and
        nothing changed, while requests are running or waiting."""
        if self.running or self.waiting:
            return False
        self.kv.cache.reset()
        self._refresh_gauges()
        return True

    def check_invariants(self) -> None:
        holding = list(self.running.values())
        for rooms in (self.prefill_rooms, self.decode_rooms):
            if rooms is not None:
                holding += rooms.private_requests
        self.kv.check_invariants(holding, self.hicache.inflight_host_pages())
        for req in self.waiting:
            assert not req.pages and req.node is None, f"waiting request {req.rid} holds KV"


def token_logprob(token: int, lp: SampledLogprobs) -> TokenLogprob:
    """A step result's logprobs of `token`, as a request's output carries them."""
    return TokenLogprob(token, lp.logprob, [TopToken(t, v) for t, v in lp.top])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by binary search over C-speed slice compares."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1] beyond
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
