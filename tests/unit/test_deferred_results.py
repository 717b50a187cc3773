"""Deferred step results (ModelRunner.execute(defer=True), the overlapped loop on CUDA), run on
the CPU: a step of plain rows returns before its tokens are applied on the host; the next step's
LAST_SAMPLED inputs are gathered on the device from last_token, and its sampling first finishes
the deferred step. Whatever the order, every result and every token equals the same plans run
without deferral: greedy and seeded sampled rows, a release while a step is deferred, a new
request on the freed row, a logprobs row (never deferred), and the StepLoop posting completed
results in order."""
from __future__ import annotations

import threading

import pytest

from services.common.sampling_params import SamplingParams
from services.step.contract import LAST_SAMPLED, NewRequestSpec, StepItem, StepPlan
from services.worker.step_loop import StepLoop
from tests.unit.tiny_models import runner as tiny_runner, save_tiny

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=64)
LOGPROBS = SamplingParams(temperature=0.0, max_new_tokens=64, logprobs=True, top_logprobs=2)


def plans() -> list[StepPlan]:
    """Overlapped scheduling's shape: each decode names LAST_SAMPLED, planned before the previous
    result arrived. "a" greedy, "b" seeded sampling, "c" released after step 3, "d" admitted on
    its freed row at step 4, "e" wants logprobs (released at step 3)."""
    prompts = {"a": [5, 9, 14, 3, 7], "b": [8, 8, 2], "c": [1, 2, 3, 4], "e": [11, 12]}
    params = {"a": GREEDY, "b": SAMPLED, "c": GREEDY, "e": LOGPROBS}
    pages = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11], "d": [12, 13, 14, 15], "e": [16, 17, 18, 19]}
    out = [StepPlan(1, [NewRequestSpec(rid, p, [], params[rid], 7) for rid, p in prompts.items()],
                    [StepItem(rid, p, 0, pages[rid], True) for rid, p in prompts.items()])]
    pos = {rid: len(p) for rid, p in prompts.items()}
    live = ["a", "b", "c", "e"]
    for step in range(2, 9):
        new, released = [], []
        for rid, at in (("e", 3), ("c", 4)):  # steps 1-2 carry a logprobs row; 3+ defer
            if step == at:
                live.remove(rid)
                released.append(rid)
        items = [StepItem(rid, [LAST_SAMPLED], pos[rid], []) for rid in live]
        if step == 4:
            new.append(NewRequestSpec("d", [4, 4, 4], [], SAMPLED, 3))
            items.append(StepItem("d", [4, 4, 4], 0, pages["d"], True))
        for item in items:
            pos[item.rid] = item.start_pos + len(item.input_ids)
        if step == 4:
            live.append("d")
        out.append(StepPlan(step, new, items, released_rids=released))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = save_tiny(tmp_path_factory.mktemp("deferred"), "mistral_no_window")
    return path


def run(model_dir: str, defer: bool) -> list[tuple[list[str], list[int], list]]:
    r = tiny_runner(model_dir, page_size=4, backend="torch")
    results = [r.execute(p, defer=defer) for p in plans()]
    if defer:
        assert r.has_deferred  # the last step's tokens were never asked for
        r.finish_pending()
    assert not r.has_deferred
    assert all(req.unapplied == 0 for req in r.requests.values())
    return [(res.rids, res.next_token_ids, [lp is None for lp in res.logprobs]) for res in results]


def test_deferred_results_equal_immediate_ones(model_dir) -> None:
    immediate, deferred = run(model_dir, False), run(model_dir, True)
    assert deferred == immediate
    assert all(len(rids) >= 3 for rids, _, _ in immediate[1:])  # every step sampled several rows
    assert [rids for rids, _, _ in immediate[:3]] == [["a", "b", "c", "e"], ["a", "b", "c", "e"], ["a", "b", "c"]]
    assert immediate[3][0] == ["a", "b", "d"]  # "c" released while step 3 was deferred; "d" on its row


def test_a_step_with_a_logprobs_row_is_never_deferred(model_dir) -> None:
    r = tiny_runner(model_dir, page_size=4, backend="torch")
    first = plans()[0]
    result = r.execute(first, defer=True)
    assert not r.has_deferred and "e" in result.rids  # "e" wants logprobs: the step completed at once
    only_plain = StepPlan(2, [], [StepItem("a", [LAST_SAMPLED], 5, [])])
    result = r.execute(only_plain, defer=True)
    assert r.has_deferred and result.rids == []  # completed later
    r.finish_pending()
    assert result.rids == ["a"] and len(result.next_token_ids) == 1


def test_the_step_loop_posts_completed_results_in_order(model_dir) -> None:
    reference = run(model_dir, False)
    r = tiny_runner(model_dir, page_size=4, backend="torch")
    posted = []

    def step(plan: StepPlan):
        result = r.execute(plan, defer=True)
        if r.has_deferred:
            return lambda: (r.finish_pending(), (result.rids, result.next_token_ids))[1]
        return result.rids, result.next_token_ids

    loop = StepLoop(r, step, posted.append)
    for p in plans():
        loop.put(p)
    loop.finish()
    thread = threading.Thread(target=loop.run)
    thread.start()
    thread.join(60)
    assert posted[-1] is None
    assert [item[0] for item in posted[:-1]] == list(range(1, 9))
    assert [item[1] for item in posted[:-1]] == [(rids, tokens) for rids, tokens, _ in reference]
