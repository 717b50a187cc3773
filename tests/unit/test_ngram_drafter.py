"""Prompt-lookup drafting: the longest earlier n-gram wins, its continuation is proposed, the
index follows accepted tokens, and each request has its own."""
from __future__ import annotations

import pytest

from services.worker.speculative.drafter import DraftRequest, algorithms, create_drafter
from services.worker.speculative.ngram import NgramDrafter, NgramIndex


def index(tokens: list[int], min_n: int = 1, max_n: int = 3) -> NgramIndex:
    ix = NgramIndex(min_n, max_n)
    ix.extend(tokens)
    return ix


def test_the_continuation_of_the_latest_occurrence_is_proposed():
    assert index([1, 2, 3, 4, 9, 1, 2]).propose(2) == [3, 4]
    assert index([1, 2, 3, 1, 2, 5, 1, 2]).propose(3) == [5, 1, 2]  # the latest "1 2" is followed by 5


def test_the_longest_matching_suffix_wins():
    # "2" alone was last followed by 8; "1 2" by 3: the longer match is the better predictor.
    assert index([1, 2, 3, 7, 2, 8, 1, 2]).propose(1) == [3]
    assert index([1, 2, 3, 7, 2, 8, 1, 2], max_n=1).propose(1) == [8]


def test_no_match_proposes_nothing_and_the_current_suffix_is_not_its_own_match():
    assert index([1, 2, 3, 4]).propose(4) == []
    assert index([5]).propose(3) == []
    assert index([5, 5]).propose(3) == [5]  # "5" occurred before, followed by the current 5
    assert index([1, 2, 3, 4, 5, 6]).propose(0) == []


def test_min_n_ignores_shorter_matches():
    assert index([1, 2, 9, 3, 2], min_n=2).propose(2) == []
    assert index([1, 2, 9, 3, 2], min_n=1).propose(2) == [9, 3]


def test_a_proposal_stops_at_the_known_tokens():
    assert index([4, 5, 6, 4]).propose(10) == [5, 6, 4]


def test_the_index_follows_accepted_tokens():
    ix = index([1, 2, 3])
    assert ix.propose(2) == []
    ix.extend([9, 1])
    assert ix.propose(2) == [2, 3]
    ix.extend([2, 7, 1])
    assert ix.propose(2) == [2, 7]  # "7 1" never occurred; the latest "1" was followed by 2 7


def test_the_drafter_keeps_one_index_per_request_and_forgets_released_ones():
    d = NgramDrafter(1, 3)
    d.admit("a", [1, 2, 3, 1])
    d.admit("b", [7, 8, 9, 7])
    assert d.propose([DraftRequest("a", 2), DraftRequest("b", 2), DraftRequest("a", 0)]) == [[2, 3], [8, 9], []]
    d.extend("a", [2, 3, 4])
    assert d.propose([DraftRequest("a", 3)]) == [[]]  # "4" never occurred before
    d.release("a")
    assert "a" not in d.indices and "b" in d.indices


def test_the_registry_builds_ngram_from_the_flags_and_refuses_unknown_names():
    from services.worker.config import SPECULATIVE_ALGORITHMS, WorkerConfig
    assert algorithms() == sorted(SPECULATIVE_ALGORITHMS)  # the flag's values: a drafter for each
    cfg = WorkerConfig(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=2,
                       speculative_ngram_max_match_window_size=5)
    d = create_drafter("NGRAM", cfg, None)
    assert isinstance(d, NgramDrafter) and (d.min_n, d.max_n) == (2, 5)
    with pytest.raises(ValueError, match="speculative-algorithm"):
        WorkerConfig(speculative_algorithm="MEDUSA")
    with pytest.raises(ValueError, match="n-gram window"):
        NgramDrafter(3, 2)
