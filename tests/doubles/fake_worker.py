"""A model-free worker for scheduler tests: the KV pool stores token ids.

Every step it checks that each request's page table maps positions [0, start)
to slots holding exactly the request's own tokens — so a page shared wrongly,
freed early or mapped late shows up as a wrong token — and "samples" a token
that is a pure function of the sequence, so outputs can be checked exactly.
"""
from __future__ import annotations

from services.step.contract import LAST_SAMPLED, StepPlan, StepResult, SampledLogprobs

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
    def __init__(self, num_pages: int, page_size: int, max_requests: int = 1 << 30):
        self.page_size = page_size
        self.max_requests = max_requests  # the real worker's page-table rows
        self.slots = [-1] * (num_pages * page_size)
        self.tables: dict[str, list[int]] = {}
        self.seqs: dict[str, list[int]] = {}
        self.steps = 0
        self.forward_steps = 0  # steps that ran tokens (not only releases or KV copies)
        self.filled = 0  # LAST_SAMPLED inputs filled in (overlapped scheduling)

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
            assert seq[item.start_pos:item.start_pos + len(item.input_ids)] == item.input_ids, item.rid
            for pos in range(item.start_pos):  # the KV this step reads
                got = self.slots[self._slot(table, pos)]
                assert got == seq[pos], f"{item.rid}: KV at position {pos} holds {got}, expected {seq[pos]}"
            for i, tok in enumerate(item.input_ids):  # the KV this step writes
                self.slots[self._slot(table, item.start_pos + i)] = tok
            if item.sample:
                tok = next_token(seq[:item.start_pos + len(item.input_ids)])
                seq.append(tok)
                result.rids.append(item.rid)
                result.next_token_ids.append(tok)
                result.logprobs.append(SampledLogprobs(-0.5))
        return result

    def _slot(self, table: list[int], pos: int) -> int:
        page = pos // self.page_size
        assert page < len(table), f"position {pos} is past the page table ({len(table)} pages)"
        return table[page] * self.page_size + pos % self.page_size
