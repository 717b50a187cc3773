"""Prefill/decode disaggregation in the scheduler core: a prefill core and a decode core, each
against a model-free worker that checks every KV read (tests/doubles/fake_worker.py), with the
prefill worker's KVSends copying page slots into the decode worker's pool as a transfer engine
copies bytes. A page sent wrong, late or into the wrong place fails the decode worker's check."""
from __future__ import annotations

import random
import time
from collections import deque

import pytest

from services.common.outputs import FinishReason
from services.common.sampling_params import InvalidRequest, SamplingParams
from services.scheduler.config import SchedulerConfig
from services.scheduler.disaggregation import DECODE, PREFILL, Attachment, DisaggregationConfig, PDSpec, prompt_digest
from services.scheduler.scheduler import ModelLimits, Scheduler
from tests.doubles.fake_worker import VOCAB, FakeWorker, reference_output

EOS = 0
PAGE = 4


class Pair:
    """One prefill core and one decode core, their workers, and the handshake between them
    (what the scheduler services carry over PrefillBootstrap)."""

    def __init__(self, prefill_pages=96, decode_pages=96, chunk=8, depth=1, attach_delay=0, timeout_s=60.0):
        def core(mode, pages):
            return Scheduler(SchedulerConfig(chunked_prefill_size=chunk), ModelLimits(pages, PAGE, 512, VOCAB, (EOS,)),
                             disaggregation=DisaggregationConfig(mode, timeout_s))
        self.p, self.d = core(PREFILL, prefill_pages), core(DECODE, decode_pages)
        self.pw, self.dw = FakeWorker(prefill_pages, PAGE), FakeWorker(decode_pages, PAGE)
        self.pw.peers["decode-0"] = self.dw
        self.depth, self.attach_delay = depth, attach_delay
        self.inflight = {id(self.p): deque(), id(self.d): deque()}
        self.outputs: dict[str, list] = {}  # decode side: rid -> [tokens, finish, cached, error]
        self.prefill_outputs: dict[str, list] = {}
        self.attachments: deque = deque()  # (rounds left, need)
        self.rooms: dict[str, str] = {}  # room -> rid
        self.needs: list = []

    def submit(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        room = f"room-{rid}"
        self.rooms[room] = rid
        self.p.submit(rid, prompt, sampling, 0, pd=PDSpec(PREFILL, room))
        self.d.submit(rid, prompt, sampling, 0, pd=PDSpec(DECODE, room, "127.0.0.1:1"))

    def _step(self, core: Scheduler, worker: FakeWorker, sink: dict) -> None:
        sent = self.inflight[id(core)]
        plan = core.schedule()
        if plan is not None:
            sent.append(plan)
        outs = core.take_outputs()
        if sent and (plan is None or len(sent) >= self.depth):
            outs += core.process(worker.execute(sent.popleft()))
        for o in outs:
            entry = sink.setdefault(o.rid, [[], None, 0, None])
            assert entry[1] is None, f"{o.rid} ended twice"
            entry[0].extend(o.token_ids)
            if o.finished:
                entry[1], entry[2], entry[3] = o.finish_reason, o.cached_tokens, o.error

    def _handshake(self) -> None:
        for need in self.d.take_attach_needed():
            self.needs.append(need)
            self.attachments.append([self.attach_delay, need])
        while self.attachments and self.attachments[0][0] <= 0:
            need = self.attachments.popleft()[1]
            try:
                self.p.attach_room(need.room, Attachment("decode-0", need.dst_pages, need.skip_tokens,
                                                         need.prompt_tokens, need.digest))
            except InvalidRequest as e:
                self.d.kv_failed(need.rid, str(e))
        for pending in self.attachments:
            pending[0] -= 1
        for event in self.p.take_room_events():
            rid = self.rooms[event.room]
            if event.kind == "done":
                self.d.kv_arrived(rid, event.first_token, event.logprob, event.cached_tokens)
            elif event.kind == "error":
                self.d.kv_failed(rid, event.error)

    def run(self, max_rounds=2000) -> dict:
        for _ in range(max_rounds):
            self._step(self.p, self.pw, self.prefill_outputs)
            self._step(self.d, self.dw, self.outputs)
            self._handshake()
            self.p.check_invariants()
            self.d.check_invariants()
            if not self.busy():
                return self.outputs
        raise AssertionError("the pair did not go idle")

    def busy(self) -> bool:
        return any(self.inflight[id(c)] or c.has_work for c in (self.p, self.d)) or bool(self.attachments) \
            or bool(self.d.decode_rooms.receiving) or bool(self.p.prefill_rooms.rooms)

    def assert_pages_back(self) -> None:
        for core in (self.p, self.d):
            kv = core.kv
            assert kv.allocator.num_free + kv.cache.cached_pages == kv.num_pages
            assert kv.cache.locked_pages == 0
        assert not self.p.prefill_rooms.rooms and not self.p.prefill_rooms.held
        assert not self.d.decode_rooms.receiving and not self.d.decode_rooms.incoming


def greedy(max_new=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("attach_delay", [0, 6])
def test_pairs_decode_what_one_replica_would_and_give_every_page_back(depth, attach_delay):
    pair = Pair(depth=depth, attach_delay=attach_delay)
    prompts = {f"r{i}": prompt(i, 5 + 7 * i) for i in range(5)}  # up to 33 tokens: chunks of 8, partial pages
    for rid, ids in prompts.items():
        pair.submit(rid, ids, greedy(ignore_eos=True))
    out = pair.run()
    for rid, ids in prompts.items():
        tokens, finish, cached, error = out[rid]
        assert error is None, error
        assert tokens == reference_output(ids, 8), rid
        assert finish is FinishReason.LENGTH
        assert 0 <= cached <= len(ids)
        assert pair.prefill_outputs[rid][0] == tokens[:1]  # the prefill side's one token is the client's first
    pair.assert_pages_back()


def test_a_prefix_the_decode_side_holds_crosses_once():
    pair = Pair()
    system = prompt(99, 24)  # six whole pages
    pair.submit("first", system + [7, 8, 9], greedy(ignore_eos=True))
    pair.run()
    pair.submit("second", system + [3, 4], greedy(ignore_eos=True))
    out = pair.run()
    first, second = pair.needs
    assert first.skip_tokens == 0
    assert second.skip_tokens == 24 and len(second.dst_pages) == 1  # only the last page crossed
    assert out["second"][0] == reference_output(system + [3, 4], 8)
    assert out["second"][2] <= len(system) + 2  # cached_tokens never exceeds prompt_tokens
    pair.assert_pages_back()


def test_a_first_token_that_ends_the_request_ends_it_on_the_decode_side():
    ids = prompt(5, 9)
    first = reference_output(ids, 1)[0]
    pair = Pair()
    pair.submit("eos", ids, greedy(stop_token_ids=[first]))
    out = pair.run()
    assert out["eos"][0] == [first] and out["eos"][1] is FinishReason.STOP
    pair.assert_pages_back()


def test_a_failed_send_fails_the_request_on_both_sides_and_frees_its_pages():
    pair = Pair()
    pair.pw.failing_rooms.add("room-bad")
    pair.submit("bad", prompt(1, 20), greedy())
    pair.submit("good", prompt(2, 20), greedy(ignore_eos=True))
    out = pair.run()
    assert out["bad"][1] is FinishReason.ERROR and "refused the connection" in out["bad"][3]
    assert pair.prefill_outputs["bad"][1] is FinishReason.ERROR
    assert out["good"][0] == reference_output(prompt(2, 20), 8)
    pair.assert_pages_back()


def test_aborts_on_either_side_reach_the_other_and_leak_nothing():
    pair = Pair(attach_delay=3)
    for i in range(4):
        pair.submit(f"a{i}", prompt(10 + i, 30), greedy(ignore_eos=True))
    for _ in range(3):
        pair._step(pair.p, pair.pw, pair.prefill_outputs)
        pair._step(pair.d, pair.dw, pair.outputs)
        pair._handshake()
    pair.d.abort("a0")  # the client went away: the decode side drops its reserved pages
    pair.p.detach_room("room-a0")  # its Attach call ends, so the prefill side drops the request
    pair.p.abort("a1")  # the prefill side fails: the decode side hears of it
    out = pair.run()
    assert out["a0"][1] is FinishReason.ABORT
    assert out["a1"][1] is FinishReason.ERROR and "prefill side" in out["a1"][3]
    for rid in ("a2", "a3"):
        assert out[rid][0] == reference_output(prompt(10 + int(rid[1]), 30), 8)
    pair.assert_pages_back()


def test_a_room_nobody_attaches_to_times_out_on_the_prefill_side():
    pair = Pair(timeout_s=0.05, attach_delay=10 ** 6)
    pair.submit("lonely", prompt(3, 12), greedy())
    for _ in range(20):
        pair._step(pair.p, pair.pw, pair.prefill_outputs)
    pair._step(pair.d, pair.dw, pair.outputs)  # pages reserved, its attachment never delivered
    time.sleep(0.06)
    pair._step(pair.p, pair.pw, pair.prefill_outputs)
    assert pair.prefill_outputs["lonely"][1] is FinishReason.ERROR
    assert "no decode side attached" in pair.prefill_outputs["lonely"][3]
    events = pair.p.take_room_events()
    assert [e.kind for e in events] == ["error"]
    pair.d.kv_failed("lonely", events[0].error)
    assert pair.outputs == {} and pair.d.take_outputs()[0].finish_reason is FinishReason.ERROR
    pair.d.take_attach_needed()
    pair.attachments.clear()
    pair.assert_pages_back()


def test_attachments_that_do_not_fit_the_room_are_refused():
    pair = Pair()
    ids = prompt(4, 10)
    pair.p.submit("x", ids, greedy(), 0, pd=PDSpec(PREFILL, "room-x"))
    with pytest.raises(InvalidRequest, match="another prompt"):
        pair.p.attach_room("room-x", Attachment("decode-0", [1, 2, 3], 0, 10, prompt_digest(ids[::-1])))
    with pytest.raises(InvalidRequest, match="needs 3 destination pages"):
        pair.p.attach_room("room-x", Attachment("decode-0", [1, 2], 0, 10, prompt_digest(ids)))
    with pytest.raises(InvalidRequest, match="whole pages"):
        pair.p.attach_room("room-x", Attachment("decode-0", [1, 2], 3, 10, prompt_digest(ids)))
    pair.p.attach_room("room-x", Attachment("decode-0", [1, 2, 3], 0, 10, prompt_digest(ids)))
    with pytest.raises(InvalidRequest, match="attached already"):
        pair.p.attach_room("room-x", Attachment("decode-0", [1, 2, 3], 0, 10, prompt_digest(ids)))


@pytest.mark.parametrize("mode,pd,match", [
    (PREFILL, None, "prefill side of disaggregated pairs"),
    (DECODE, PDSpec(PREFILL, "r"), "decode side of disaggregated pairs"),
    ("null", PDSpec(DECODE, "r", "h:1"), "not disaggregated"),
    (DECODE, PDSpec(DECODE, "r"), "bootstrap_address is required"),
    (PREFILL, PDSpec(PREFILL, ""), "room is required"),
])
def test_a_request_must_play_this_replicas_part(mode, pd, match):
    core = Scheduler(SchedulerConfig(), ModelLimits(32, PAGE, 512, VOCAB, (EOS,)),
                     disaggregation=DisaggregationConfig(mode))
    with pytest.raises(InvalidRequest, match=match):
        core.submit("q", [1, 2, 3], greedy(), 0, pd=pd)
