"""A model-free worker for scheduler tests: the KV pool stores token ids.

Every step it checks that each request's page table maps positions [0, start)
to slots holding exactly the request's own tokens — so a page shared wrongly,
freed early or mapped late shows up as a wrong token — and "samples" a token
that is a pure function of the sequence, so outputs can be checked exactly.

With `draft_hits` set it speculates as the model runner does: an item with draft_depth > 0
gets a draft whose first `draft_hits` tokens are the true continuation and the rest wrong,
and a verify item keeps the draft's prefix its own sampling agrees with plus its token after
it, having written KV for every draft token (a rejected one's slot then holds a wrong token:
reading it later, through accounting that kept it, fails the KV check).
"""
from __future__ import annotations

from services.step.contract import LAST_SAMPLED, KVSendResult, SampledLogprobs, StepPlan, StepResult, TokenRun

VOCAB = 50


def next_token(seq: list[int]) -> int:
    return (sum(seq[-3:]) * 31 + len(seq)) % VOCAB


def reference_output(prompt: list[int], max_new: int, stop_ids=()) -> list[int]:
    seq, out = list(prompt), []
    while len(out) < max_new:
        tok = next_token(seq)
        seq.append(tok)
        out.append(tok)
        if tok in stop_ids:
            break
    return out


class FakeWorker:
    def __init__(self, num_pages: int, page_size: int, max_requests: int = 1 << 30, draft_hits: int | None = None,
                 timing: tuple[float, float, float] | None = None):
        self.page_size = page_size
        self.draft_hits = draft_hits  # None: no drafter
        # Reported step times (StepResult.forward_seconds, draft_seconds), or none: (a one-token
        # step's seconds, each further token's, each drafted token's).
        self.timing = timing
        self.verify_rows: list[int] = []  # tokens of each verify item run
        self.decode_rows: list[int] = []  # per step, the tokens of its decode and verify items
        self.max_requests = max_requests  # the real worker's page-table rows
        self.slots = [-1] * (num_pages * page_size)
        self.tables: dict[str, list[int]] = {}
        self.seqs: dict[str, list[int]] = {}
        self.steps = 0
        self.forward_steps = 0  # steps that ran tokens (not only releases or KV copies)
        self.filled = 0  # LAST_SAMPLED inputs filled in (overlapped scheduling)
        # Disaggregation: the decode workers a plan's KVSends name (descriptor -> worker), and the
        # rooms whose sends fail (the transfer engine's error).
        self.peers: dict[str, "FakeWorker"] = {}
        self.failing_rooms: set[str] = set()

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        self.forward_steps += bool(plan.items)
        for rid in plan.released_rids:  # released first, as the model runner does
            assert rid in self.tables, f"released unknown request {rid}"
            self.tables.pop(rid)
            self.seqs.pop(rid)
        for spec in plan.new_requests:
            self.tables[spec.rid] = []
            self.seqs[spec.rid] = list(spec.prompt_ids) + list(spec.output_ids)
        assert len(self.tables) <= self.max_requests, f"worker holds {len(self.tables)} requests"
        result = StepResult(plan.step_id)
        self.decode_rows.append(sum(len(i.input_ids) for i in plan.items if i.verify or len(i.input_ids) == 1))
        for item in plan.items:
            table = self.tables[item.rid]
            if item.reset_pages:
                table[:] = item.new_pages
            else:
                table.extend(item.new_pages)
            seq = self.seqs[item.rid]
            if item.input_ids == [LAST_SAMPLED]:  # planned before the scheduler knew it: ours
                assert item.start_pos == len(seq) - 1, f"{item.rid}: LAST_SAMPLED at {item.start_pos}, len {len(seq)}"
                item.input_ids = [seq[-1]]
                self.filled += 1
            known = 1 if item.verify else len(item.input_ids)  # a verify item's draft is not in seq yet
            assert seq[item.start_pos:item.start_pos + known] == item.input_ids[:known], item.rid
            for pos in range(item.start_pos):  # the KV this step reads
                got = self.slots[self._slot(table, pos)]
                assert got == seq[pos], f"{item.rid}: KV at position {pos} holds {got}, expected {seq[pos]}"
            for i, tok in enumerate(item.input_ids):  # the KV this step writes
                self.slots[self._slot(table, item.start_pos + i)] = tok
            if item.sample:
                run = self._verify(seq, item) if item.verify else [next_token(seq[:item.start_pos + len(item.input_ids)])]
                seq.extend(run)
                result.rids.append(item.rid)
                result.next_token_ids.append(run[0])
                result.logprobs.append(SampledLogprobs(-0.5))
                if self.draft_hits is not None:
                    result.accepted.append(TokenRun(run[1:]))
                    result.drafts.append(TokenRun(self._draft(seq, item.draft_depth), speculative=True))
        result.kv_sends = [self._send(send) for send in plan.kv_sends]  # after the forward
        if self.timing is not None and plan.items:
            one, per_token, per_draft = self.timing
            result.draft_seconds = per_draft * sum(i.draft_depth for i in plan.items)
            tokens = sum(len(i.input_ids) for i in plan.items)
            result.forward_seconds = one + per_token * (tokens - 1) + result.draft_seconds
        return result

    def _send(self, send) -> KVSendResult:
        """Copy whole pages' slots into the peer's pool, as a transfer engine copies their bytes."""
        if send.room in self.failing_rooms:
            return KVSendResult(send.room, error=f"peer {send.descriptor} refused the connection")
        peer, ps = self.peers[send.descriptor], self.page_size
        assert len(send.src_pages) == len(send.dst_pages), send
        for src, dst in zip(send.src_pages, send.dst_pages):
            peer.slots[dst * ps:(dst + 1) * ps] = self.slots[src * ps:(src + 1) * ps]
        return KVSendResult(send.room, len(send.src_pages), len(send.src_pages) * ps * 8, 1e-4)

    def _verify(self, seq: list[int], item) -> list[int]:
        """The tokens a verify item produces: the draft's agreeing prefix, then the next token."""
        self.verify_rows.append(len(item.input_ids))
        context, run = seq[:item.start_pos + 1], []
        for drafted in item.input_ids[1:] + [None]:
            run.append(next_token(context))
            if run[-1] != drafted:
                break
            context.append(drafted)
        return run

    def _draft(self, seq: list[int], depth: int) -> list[int]:
        """depth tokens: the true continuation for draft_hits of them, then wrong ones."""
        context, draft = list(seq), []
        for i in range(depth):
            tok = next_token(context)
            draft.append(tok if i < self.draft_hits else (tok + 1) % VOCAB)
            context.append(draft[-1])
        return draft

    def _slot(self, table: list[int], pos: int) -> int:
        page = pos // self.page_size
        assert page < len(table), f"position {pos} is past the page table ({len(table)} pages)"
        return table[page] * self.page_size + pos % self.page_size
