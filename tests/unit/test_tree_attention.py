"""Tree verification on the target side: BatchLayout's tree items, TorchAttentionBackend's tree
mask, KVPool.move_slots. The contract checked: a draft tree verified in one step gives every node
the attention output it would get as the last token of its own root-to-node path verified as a
chain (same RoPE positions, the ancestors' K/V), in a step mixed with a decode and a plain
extend item whose outputs the tree does not change; and once the accepted path's K/V are moved
to their positions, the request's KV is what verifying that path as a chain would have written.
Random q/k/v straight into the backend, a tiny pool: no model."""
from __future__ import annotations

import pytest
import torch

from services.worker.attention.batch_layout import BatchLayout, slots_of
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.kv_pool import KVPool, KVPoolSpec
from services.worker.model.layer_attention import LayerAttention
from services.worker.speculative.tree import DraftTree, compaction_slots

H, HKV, D, LAYERS, SCALE = 4, 2, 16, 2, 0.25
FP8 = torch.float8_e4m3fn
# None: the backend's own; windows that cut into the prefix and into the path (2: a node's
# ancestor two levels up is dropped though its slot is nearer); Gemma 2's soft-cap
VARIANTS = [None, LayerAttention(0.3, window=5), LayerAttention(0.3, window=2), LayerAttention(0.2, softcap=2.0)]
STARTS, Q_LENS = [9, 13, 5], [1, None, 6]  # a decode item, the tree item, a plain extend item
TREE_ITEM = 1


def _random_tree(g: torch.Generator, n: int) -> DraftTree:
    """n nodes, each under a random earlier node; tokens unique, so accept's walk is unambiguous."""
    parents = [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n + 1)]
    return DraftTree([100 + i for i in range(1, n + 1)], parents)


def _pool(g: torch.Generator, dtype: torch.dtype, page_size: int) -> tuple[KVPool, torch.Tensor]:
    """A pool holding random prefix K/V (positions < start) for each item, and its page rows [3, P]."""
    pool = KVPool(KVPoolSpec(96 // page_size, page_size, LAYERS, HKV, D, dtype))
    per_item = 32 // page_size
    rows = torch.randperm(pool.spec.num_pages, generator=g)[:3 * per_item].view(3, per_item)
    item = torch.repeat_interleave(torch.arange(3), torch.tensor(STARTS))
    pos = torch.cat([torch.arange(s) for s in STARTS])
    slots = slots_of(rows, item, pos, page_size)
    for layer in range(LAYERS):
        pool.write(layer, slots, torch.randn(len(slots), HKV, D, generator=g) * 2,
                   torch.randn(len(slots), HKV, D, generator=g))
    return pool, rows


def _copy(pool: KVPool) -> KVPool:
    other = KVPool(pool.spec)
    other.k.copy_(pool.k)
    other.v.copy_(pool.v)
    return other


def _run(backend: TorchAttentionBackend, layout: BatchLayout, pool: KVPool, qkv: list, variant) -> list:
    """Every layer's output [T, H, D] for the step's q, k, v (one triple per layer)."""
    backend.prepare(layout, pool)
    return [backend.forward(layer, q, k, v, variant) for layer, (q, k, v) in enumerate(qkv)]


def _qkv(g: torch.Generator, T: int) -> list:
    return [(torch.randn(T, H, D, generator=g), torch.randn(T, HKV, D, generator=g) * 2,
             torch.randn(T, HKV, D, generator=g)) for _ in range(LAYERS)]


def _pick(qkv: list, index: torch.Tensor) -> list:
    return [tuple(x[index] for x in t) for t in qkv]


def test_tree_layout_positions_and_slots():
    tree = DraftTree([1, 2, 3, 4], [0, 0, 1, 2])  # depths 0, 1, 1, 2, 2
    rows = torch.tensor([[3, 0], [1, 2]])
    layout = BatchLayout.build([2, 5], [4, 2], rows, 4, trees={1: tree})
    plain = BatchLayout.build([2, 5], [4, 2], rows, 4)
    assert layout.positions.tolist() == [4, 5, 2, 3, 3, 4, 4]
    assert torch.equal(layout.out_slots, plain.out_slots)  # slots of positions start + i
    assert torch.equal(layout.kv_lens, plain.kv_lens) and layout.trees == {1: tree}
    assert plain.trees is None and BatchLayout.build([2], [0], rows[:1], 4, trees={}).trees is None
    with pytest.raises(ValueError, match="item 1 has 4 tokens but its draft tree 5 nodes"):
        BatchLayout.build([2, 4], [4, 2], rows, 4, trees={1: tree})


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tree_nodes_attend_as_their_paths_do(dtype, page_size, native, variant):
    g = torch.Generator().manual_seed(page_size + 7 * (dtype == FP8))
    tree = _random_tree(g, 9)
    q_lens = [q or tree.n + 1 for q in Q_LENS]
    pool, rows = _pool(g, dtype, page_size)
    before = _copy(pool)
    layout = BatchLayout.build(q_lens, STARTS, rows, page_size, trees={TREE_ITEM: tree})
    qkv = _qkv(g, sum(q_lens))
    backend = TorchAttentionBackend(SCALE, native_decode=native)
    got = _run(backend, layout, pool, qkv, variant)
    tol = dict(atol=1e-5, rtol=1e-5)

    # the decode and plain extend items: as in the same step with the tree item read as a chain
    as_chain = _run(backend, BatchLayout.build(q_lens, STARTS, rows, page_size), _copy(before), qkv, variant)
    others = layout.token_item != TREE_ITEM
    for layer in range(LAYERS):
        torch.testing.assert_close(got[layer][others], as_chain[layer][others], **tol)

    # each node: the last token of its root-to-node path, verified alone as a chain item
    first = sum(q_lens[:TREE_ITEM])
    start = STARTS[TREE_ITEM]
    anc = tree.ancestor_mask()
    for node in range(tree.n + 1):
        path = first + anc[node].nonzero().flatten()  # the step's token indices, root first
        chain = BatchLayout.build([len(path)], [start], rows[TREE_ITEM:TREE_ITEM + 1], page_size)
        want = _run(TorchAttentionBackend(SCALE), chain, _copy(before), _pick(qkv, path), variant)
        for layer in range(LAYERS):
            torch.testing.assert_close(got[layer][first + node], want[layer][-1], **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_move_slots_copies_every_layers_rows_through_a_temp(dtype):
    pool = KVPool(KVPoolSpec(4, 4, LAYERS, HKV, D, dtype))
    g = torch.Generator().manual_seed(1)
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(16), torch.randn(16, HKV, D, generator=g), torch.randn(16, HKV, D, generator=g))
    k0, v0 = pool.k.clone(), pool.v.clone()
    src, dst = torch.tensor([5, 6, 9]), torch.tensor([4, 5, 6])  # 5 and 6: moved from and then to
    pool.move_slots(src, dst)
    as_bytes = (lambda x: x.view(torch.uint8)) if dtype == FP8 else (lambda x: x)
    for new, old in ((pool.k, k0), (pool.v, v0)):
        assert torch.equal(as_bytes(new[:, dst]), as_bytes(old[:, src]))
        untouched = torch.tensor([s for s in range(16) if s not in (4, 5, 6)])
        assert torch.equal(as_bytes(new[:, untouched]), as_bytes(old[:, untouched]))
    pool.move_slots(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    with pytest.raises(ValueError, match="as many sources as destinations"):
        pool.move_slots(src, dst[:2])


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
@pytest.mark.parametrize("page_size", [1, 4])
def test_accepted_path_moved_into_place_is_the_chains_kv(dtype, page_size):
    """Verify a tree, accept a deep path, move its K/V to positions start + depth; the request's
    KV up to start + accepted equals a chain verify of that path, and a decode step after it
    attends alike."""
    g = torch.Generator().manual_seed(3 + page_size)
    tree = _random_tree(g, 10)
    q_lens = [q or tree.n + 1 for q in Q_LENS]
    pool, rows = _pool(g, dtype, page_size)
    chain_pool = _copy(pool)
    layout = BatchLayout.build(q_lens, STARTS, rows, page_size, trees={TREE_ITEM: tree})
    qkv = _qkv(g, sum(q_lens))
    backend = TorchAttentionBackend(SCALE)
    _run(backend, layout, pool, qkv, None)

    leaf = max(range(tree.n + 1), key=lambda i: tree.depths()[i])  # the deepest node's path
    path = tree.ancestor_mask()[leaf].nonzero().flatten()  # [root, ..., leaf]
    picks = [0] * (tree.n + 1)
    for parent, child in zip(path[:-1].tolist(), path[1:].tolist()):
        picks[parent] = tree.tokens[child - 1]
    picks[leaf] = 7  # the bonus token
    produced, nodes = tree.accept(picks)
    assert nodes == path[1:].tolist() and produced == tree.path(leaf) + [7]

    start, row = STARTS[TREE_ITEM], rows[TREE_ITEM:TREE_ITEM + 1]
    pool.move_slots(*compaction_slots(row[0], page_size, start, nodes))

    first = sum(q_lens[:TREE_ITEM])
    chain = BatchLayout.build([len(path)], [start], row, page_size)
    _run(TorchAttentionBackend(SCALE), chain, chain_pool, _pick(qkv, first + path), None)
    kept = slots_of(row, torch.zeros(start + len(path), dtype=torch.int64), torch.arange(start + len(path)),
                    page_size)
    for a, b in ((pool.k, chain_pool.k), (pool.v, chain_pool.v)):
        assert torch.equal(a[:, kept].view(torch.uint8), b[:, kept].view(torch.uint8))

    # the next decode step, over the compacted KV and over the chain's
    step = BatchLayout.build([1], [start + len(path)], row, page_size)
    nxt = _qkv(g, 1)
    got = _run(backend, step, pool, nxt, None)
    want = _run(TorchAttentionBackend(SCALE), step, chain_pool, nxt, None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
