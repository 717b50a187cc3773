"""Prefill/decode disaggregation in the scheduler core (docs/disaggregation.md).

A disaggregated request runs on a pair of replicas that the router chose, both given the same
`room`:
- The **prefill side** computes the prompt and samples the first token. Once the decode side
  has attached (its pre-allocated pages and its worker's transfer descriptor), each plan
  carries KVSends for the pages its steps complete, which the worker writes into the decode
  worker's pool after the forward: the KV crosses page by page as chunked prefill goes on.
  When every page is confirmed and the first token is known, the room is done: the decode
  side gets the token, and the request ends here.
- The **decode side** matches the prompt against its own radix cache, pre-allocates pages for
  the rest, and asks its service to attach to the prefill side (`AttachNeeded`). When the
  prefill side's Done arrives, the request starts decoding from the first token; on any
  failure its pre-allocated pages are freed without entering the tree.

Both are transport-free (the scheduler service carries the handshake, the worker the bytes);
every page a room holds is private to its request, so `check_invariants` counts it.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from services.common.outputs import TokenLogprob
from services.common.sampling_params import InvalidRequest
from services.scheduler.request import Request
from services.step.contract import KVSend, KVSendResult, StepPlan

PREFILL, DECODE = "prefill", "decode"
MODES = ("null", PREFILL, DECODE)  # "null" = co-located


@dataclass(frozen=True)
class DisaggregationConfig:
    """A scheduler service's side of disaggregation (the in-process Engine has none)."""
    disaggregation_mode: str = field(default="null", metadata={
        "help": "prefill/decode disaggregation: null (co-located), prefill (compute prompts and send their KV "
                "to a decode replica) or decode (receive the KV, then decode); must match the worker's "
                "(docs/disaggregation.md)"})
    disaggregation_timeout_s: float = field(default=60.0, metadata={
        "help": "disaggregation: how long a prefill side holds a request no decode side attached to, and an "
                "attachment whose request has not arrived"})

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in MODES:
            raise ValueError(f"--disaggregation-mode must be one of {MODES}, got {self.disaggregation_mode!r}")
        if not self.disaggregation_timeout_s > 0:
            raise ValueError(f"--disaggregation-timeout-s must be > 0, got {self.disaggregation_timeout_s}")


@dataclass(frozen=True)
class PDSpec:
    """A request's part in a pair."""
    role: str  # PREFILL | DECODE
    room: str
    bootstrap_address: str = ""  # DECODE: the prefill scheduler's PrefillBootstrap


def prompt_digest(ids: list[int]) -> bytes:
    """What both sides compare so a room is never filled with another prompt's KV."""
    return hashlib.sha256(array("i", ids).tobytes()).digest()


@dataclass
class Attachment:
    """The decode side's half of a room: where the prompt's pages go."""
    descriptor: str
    dst_pages: list[int]  # decode pages for tokens [skip_tokens, prompt_tokens)
    skip_tokens: int
    prompt_tokens: int
    digest: bytes
    at: float = 0.0  # when it arrived (monotonic)


@dataclass
class RoomEvent:
    """Prefill side → the decode side's Attach stream."""
    room: str
    kind: str  # "progress" | "done" | "error"
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    first_token: int = -1
    logprob: TokenLogprob | None = None
    cached_tokens: int = 0
    error: str = ""


@dataclass
class AttachNeeded:
    """Decode side → its service: pages are reserved, attach to the prefill side."""
    rid: str
    room: str
    bootstrap_address: str
    dst_pages: list[int]
    skip_tokens: int
    prompt_tokens: int
    digest: bytes


@dataclass(eq=False)
class _PrefillRoom:
    req: Request
    opened: float
    attachment: Attachment | None = None
    planned: int = 0    # pages (from the first page past skip) put in plans
    confirmed: int = 0  # pages the worker reported in place
    bytes: int = 0
    seconds: float = 0.0
    first: tuple[int, TokenLogprob | None] | None = None  # the sampled first token
    done: bool = False


class PrefillRooms:
    """The prefill side's rooms, by room id."""

    def __init__(self, page_size: int, timeout_s: float) -> None:
        self.page_size, self.timeout_s = page_size, timeout_s
        self.rooms: dict[str, _PrefillRoom] = {}
        self.early: dict[str, Attachment] = {}  # attached before the request arrived
        self.held: dict[str, Request] = {}      # rid → sampled, its pages still crossing
        self.events: list[RoomEvent] = []
        self.sent_pages = self.sent_bytes = 0   # since start, what the worker reported in place
        self.sent_seconds = 0.0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def open(self, req: Request, room: str, now: float) -> None:
        if room in self.rooms:
            raise InvalidRequest(f"disaggregation room {room!r} is already in use")
        self.rooms[room] = _PrefillRoom(req, now)
        early = self.early.pop(room, None)
        if early is not None:
            self.attach(room, early, now)

    def attach(self, room: str, att: Attachment, now: float) -> None:
        """The decode side attached. Raises InvalidRequest when the room holds another prompt
        or the pages do not fit it."""
        att.at = att.at or now
        state = self.rooms.get(room)
        if state is None:
            if room in self.early:
                raise InvalidRequest(f"room {room!r} has a decode side attached already")
            self.early[room] = att  # the request is on its way through this replica's tokenizer
            return
        if state.attachment is not None:
            raise InvalidRequest(f"room {room!r} has a decode side attached already")
        req, ps = state.req, self.page_size
        if att.prompt_tokens != len(req.prompt_ids) or att.digest != prompt_digest(req.prompt_ids):
            raise InvalidRequest(f"room {room!r} holds another prompt ({len(req.prompt_ids)} tokens here, "
                                 f"{att.prompt_tokens} at the decode side)")
        if att.skip_tokens % ps or att.skip_tokens >= att.prompt_tokens:
            raise InvalidRequest(f"skip_tokens {att.skip_tokens} must be whole pages of {ps} below the prompt")
        want = self.pages_for(att.prompt_tokens) - att.skip_tokens // ps
        if len(att.dst_pages) != want:
            raise InvalidRequest(f"room {room!r} needs {want} destination pages, got {len(att.dst_pages)}")
        state.attachment = att

    def detach(self, room: str) -> Request | None:
        """The decode side went away: its request (to abort here), if still open."""
        self.early.pop(room, None)
        state = self.rooms.get(room)
        if state is None or state.done:
            return None
        state.done = True  # nobody to tell any more
        return state.req

    def _sendable(self, state: _PrefillRoom) -> tuple[int, int]:
        """(first page past skip, last page + 1) that the steps planned so far complete."""
        req, att = state.req, state.attachment
        first = att.skip_tokens // self.page_size
        prompt = len(req.prompt_ids)
        done = min(req.computed, prompt)
        end = self.pages_for(prompt) if done >= prompt else done // self.page_size
        return first, max(end, first)

    def can_send(self) -> bool:
        """A held request's pages wait to be planned (its attachment came late)."""
        return any(self._pending_pages(self.rooms[r.pd.room]) for r in self.held.values())

    def _pending_pages(self, state: _PrefillRoom) -> int:
        if state.attachment is None or state.done:
            return 0
        first, end = self._sendable(state)
        return end - first - state.planned

    def add_sends(self, plan: StepPlan) -> None:
        """After the plan's tokens are committed: send every page they complete."""
        for room, state in self.rooms.items():
            n = self._pending_pages(state)
            if n <= 0:
                continue
            first, _ = self._sendable(state)
            lo = state.planned
            src = state.req.pages[first + lo:first + lo + n]
            plan.kv_sends.append(KVSend(room, state.attachment.descriptor, list(src),
                                        state.attachment.dst_pages[lo:lo + n]))
            state.planned += n

    def sent(self, results: list[KVSendResult]) -> list[tuple[Request, str]]:
        """The worker's answers → (request, error) for rooms whose send failed."""
        failed = []
        for r in results:
            state = self.rooms.get(r.room)
            if state is None or state.done:
                continue
            if r.error:
                failed.append((state.req, f"KV transfer to the decode side failed: {r.error}"))
                continue
            state.confirmed += r.pages
            state.bytes += r.bytes
            state.seconds += r.seconds
            self.sent_pages, self.sent_bytes = self.sent_pages + r.pages, self.sent_bytes + r.bytes
            self.sent_seconds += r.seconds
            self.events.append(RoomEvent(r.room, "progress", state.confirmed, state.bytes, state.seconds))
        return failed

    def unplan(self, plan: StepPlan) -> None:
        """A plan the worker failed: its sends never ran."""
        for send in plan.kv_sends:
            state = self.rooms.get(send.room)
            if state is not None:
                state.planned -= len(send.src_pages)

    def sampled(self, req: Request, token: int, logprob: TokenLogprob | None) -> None:
        self.rooms[req.pd.room].first = (token, logprob)

    def complete(self, req: Request) -> bool:
        """Its first token is known and every page is in place at the decode side."""
        state = self.rooms[req.pd.room]
        if state.first is None or state.attachment is None:
            return False
        first, end = self._sendable(state)
        return state.confirmed >= end - first

    def finished(self, req: Request, error: str | None) -> None:
        """The request ended here: Done for the decode side, or why not."""
        self.held.pop(req.rid, None)
        state = self.rooms.pop(req.pd.room, None)
        if state is None or state.done:
            return
        state.done = True
        if error is not None:
            self.events.append(RoomEvent(req.pd.room, "error", error=error))
            return
        token, logprob = state.first
        self.events.append(RoomEvent(req.pd.room, "done", state.confirmed, state.bytes, state.seconds,
                                     token, logprob, req.cached_tokens))

    def expired(self, now: float) -> list[Request]:
        """Requests no decode side attached to within the timeout (to end with an error); early
        attachments whose request never came get an error event."""
        for room in [r for r, att in self.early.items() if now - att.at > self.timeout_s]:
            del self.early[room]
            self.events.append(RoomEvent(room, "error", error=(
                f"no request for room {room!r} reached the prefill side within {self.timeout_s:g}s")))
        return [s.req for s in self.rooms.values()
                if s.attachment is None and not s.done and now - s.opened > self.timeout_s]

    def take_events(self) -> list[RoomEvent]:
        out, self.events = self.events, []
        return out

    @property
    def private_requests(self) -> list[Request]:
        return list(self.held.values())


@dataclass
class DecodeRooms:
    """The decode side's requests until their KV has arrived."""
    incoming: list[Request] = field(default_factory=list)         # waiting for pages
    receiving: dict[str, Request] = field(default_factory=dict)   # rid → pages reserved, KV crossing
    attach_needed: list[AttachNeeded] = field(default_factory=list)

    def take_attach_needed(self) -> list[AttachNeeded]:
        out, self.attach_needed = self.attach_needed, []
        return out

    @property
    def private_requests(self) -> list[Request]:
        return list(self.receiving.values())
