"""DraftTree (services/worker/speculative/tree.py): depths, ancestor masks, paths, acceptance
walks and truncation, on chains and a branching tree with hand-computed answers."""
from __future__ import annotations

import pytest
import torch

from services.worker.jump_forward import accepted
from services.worker.speculative.tree import DraftTree, compaction_moves, compaction_slots

#        0 (root)
#      /   \
#     1:a   2:b
#    / \      \
#  3:c  4:d    5:c
#  |
#  6:e
TREE = DraftTree(tokens=[10, 20, 30, 40, 30, 50], parents=[0, 0, 1, 1, 2, 3])


def test_depths_and_chain():
    assert TREE.n == 6
    assert TREE.depths() == [0, 1, 1, 2, 2, 2, 3]
    assert not TREE.is_chain()
    chain = DraftTree.chain([7, 8, 9])
    assert chain.parents == [0, 1, 2] and chain.is_chain()
    assert chain.depths() == [0, 1, 2, 3]
    assert DraftTree.chain([]).depths() == [0] and DraftTree.chain([]).is_chain()


def test_ancestor_mask():
    m = TREE.ancestor_mask()
    assert m.shape == (7, 7) and m.dtype == torch.bool
    want = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    for i, row in want.items():
        assert m[i].nonzero().flatten().tolist() == row
    assert torch.equal(DraftTree.chain([1, 2, 3]).ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_path():
    assert TREE.path(0) == []
    assert TREE.path(2) == [20]
    assert TREE.path(6) == [10, 30, 50]
    assert TREE.path(5) == [20, 30]
    assert DraftTree.chain([4, 5, 6]).path(2) == [4, 5]


def test_accept_walks_the_agreeing_branch():
    # picks[i] = the target's token after node i's path
    picks = [10, 30, 99, 50, 0, 0, 77]  # root→1 (a), 1→3 (c), 3→6 (e), then bonus 77 after node 6
    assert TREE.accept(picks) == ([10, 30, 50, 77], [1, 3, 6])
    picks = [20, 0, 30, 0, 0, 61, 0]  # root→2 (b), 2→5 (c), bonus 61
    assert TREE.accept(picks) == ([20, 30, 61], [2, 5])
    picks = [99, 30, 30, 50, 0, 0, 0]  # no child of the root has 99: just the pick
    assert TREE.accept(picks) == ([99], [])
    picks = [10, 40, 0, 0, 5, 0, 0]  # root→1, 1→4 (d, the second child), bonus 5
    assert TREE.accept(picks) == ([10, 40, 5], [1, 4])


def test_accept_first_sibling_wins_on_equal_tokens():
    tree = DraftTree([5, 5], [0, 0])
    assert tree.accept([5, 1, 2]) == ([5, 1], [1])


@pytest.mark.parametrize("picks", [[1, 2, 3, 4], [1, 2, 9, 4], [9, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 8]])
def test_accept_on_a_chain_is_jump_forwards(picks):
    draft = [1, 2, 3]
    produced, nodes = DraftTree.chain(draft).accept(picks)
    assert produced == accepted(draft, picks)
    assert nodes == list(range(1, len(produced)))


def test_accept_needs_one_pick_per_node():
    with pytest.raises(ValueError, match="one pick per node"):
        TREE.accept([1, 2])


def test_truncated_is_a_tree_prefix():
    t = TREE.truncated(4)
    assert t.tokens == [10, 20, 30, 40] and t.parents == [0, 0, 1, 1]
    assert t.depths() == TREE.depths()[:5]
    assert torch.equal(t.ancestor_mask(), TREE.ancestor_mask()[:5, :5])
    assert TREE.truncated(0).n == 0 and TREE.truncated(99) == TREE


@pytest.mark.parametrize("tokens, parents, match", [
    ([1, 2], [0], "one parent per token"),
    ([1, 2], [0, 2], "not an earlier node"),
    ([1], [-1], "not an earlier node"),
])
def test_invalid_trees_refused(tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(tokens, parents)


def test_compaction_moves_and_slots():
    assert compaction_moves([1, 3, 6]) == ([3, 6], [2, 3])  # node 1 already at depth 1
    assert compaction_moves([1, 2, 3]) == ([], [])  # a chain: in place
    assert compaction_moves([2, 5]) == ([2, 5], [1, 2])
    page_row = torch.tensor([7, 2, 9])  # positions 0-3 in page 7, 4-7 in page 2, 8-11 in page 9
    src, dst = compaction_slots(page_row, 4, 3, [1, 3, 6])  # positions 6, 9 → 5, 6
    assert src.tolist() == [2 * 4 + 2, 9 * 4 + 1] and dst.tolist() == [2 * 4 + 1, 2 * 4 + 2]
    src, dst = compaction_slots(page_row, 4, 3, [])
    assert src.numel() == dst.numel() == 0
