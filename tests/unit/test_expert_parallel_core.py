"""Expert parallelism's transport-free pieces: the placement and its replica choice, which expert
weights a rank loads, the moves a rebalance plans, the load recorder, and the flags' refusals.
(The all-to-all itself runs over real processes in tests/integration/test_expert_parallel.py.)"""
from __future__ import annotations

import json

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.model.config import ModelConfig
from services.worker.model.expert_load import ExpertDump, ExpertLoadRecorder
from services.worker.parallel.expert_location import ExpertLocation, pick_physical
from services.worker.parallel.expert_parallel import token_range
from services.worker.parallel.expert_rebalance import make_chunk, plan_moves
from services.worker.parallel.moe_parallel import initial_location, rank_expert_slots
from services.worker.parallel.tensor_parallel import TensorShard

MOE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  mlp_only_layers=(1,), architecture="Qwen3MoeForCausalLM")


@pytest.mark.parametrize("tokens", [0, 1, 5, 8])
def test_token_ranges_cover_every_token_once_in_order(tokens):
    ranges = [token_range(tokens, r, 3) for r in range(3)]
    assert [i for a, b in ranges for i in range(a, b)] == list(range(tokens))


def test_the_spread_placement_puts_expert_e_in_slot_e_and_replicates_the_first_ones():
    loc = ExpertLocation.spread(2, 8, 2, redundant=2)
    assert loc.slots == 5
    assert loc.rank_experts(0)[0].tolist() == [0, 1, 2, 3, 4]
    assert loc.rank_experts(1)[0].tolist() == [5, 6, 7, 0, 1]
    assert loc.logcnt[0].tolist() == [2, 2, 1, 1, 1, 1, 1, 1]


def test_a_placement_missing_an_expert_or_splitting_unevenly_is_refused():
    with pytest.raises(ValueError, match="every logical expert"):
        ExpertLocation(torch.tensor([[0, 1, 1, 3]]), 4, 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertLocation(torch.tensor([[0, 1, 2, 3, 0]]), 4, 2)


def test_replicas_split_an_experts_rows_evenly_and_every_rank_picks_the_same():
    loc = ExpertLocation.spread(1, 4, 2, redundant=2)  # experts 0 and 1 have two replicas: slots 0/4, 1/5
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 3], [1, 2]])  # expert 0: 4 rows, expert 1: 3
    physical = pick_physical(loc, 0, experts)
    assert torch.equal(loc.phy2log[0][physical], experts)  # every row lands on a replica of its expert
    assert sorted(physical[experts == 0].tolist()) == [0, 0, 4, 4]
    assert sorted(physical[experts == 1].tolist()) == [1, 1, 5]
    assert torch.equal(pick_physical(loc, 0, experts), physical)


def test_the_balanced_placement_evens_out_a_skewed_load():
    loads = torch.tensor([[10.0, 10, 900, 800, 700, 10, 10, 10]])  # three hot experts, all on rank 0 when spread
    spread, balanced = ExpertLocation.spread(1, 8, 2, 2), ExpertLocation.balanced(loads, 2, 2)
    before, after = spread.rank_loads(loads)[0], balanced.rank_loads(loads)[0]
    assert float(before.max() / before.mean()) > 1.5
    assert float(after.max() / after.mean()) <= 1.15


def test_a_rank_loads_the_whole_experts_of_its_slots_and_copies_a_replicated_one():
    slots = ((0, 5, 1, 7), (), (2, 2, 3, 4))  # layer 1 is dense; layer 2 holds expert 2 twice
    shard = TensorShard(MOE, 0, 2, slots)
    assert shard.config.expert_slots == 4 and shard.config.moe_intermediate_size == 16  # whole experts
    stacked = torch.arange(8.0).view(8, 1, 1).expand(8, 32, 16).contiguous()  # [E, 2I, H]: expert e = e
    part = shard.tensors({"model.layers.0.mlp.experts.gate_up_proj": stacked,
                          "model.layers.2.mlp.experts.3.down_proj.weight": torch.full((32, 16), 3.0),
                          "model.layers.2.mlp.experts.2.up_proj.weight": torch.full((16, 32), 2.0),
                          "model.layers.2.mlp.experts.6.gate_proj.weight": torch.zeros(16, 32)})
    assert part["model.layers.0.mlp.experts.gate_up_proj"][:, 0, 0].tolist() == [0, 5, 1, 7]
    assert sorted(part) == ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.0.up_proj.weight",
                            "model.layers.2.mlp.experts.1.up_proj.weight",
                            "model.layers.2.mlp.experts.2.down_proj.weight"]  # expert 6 is not this rank's


def test_rank_expert_slots_follow_the_first_placement_per_decoder_layer():
    config = WorkerConfig(tp_size=2, ep_size=2, ep_num_redundant_experts=2)
    assert rank_expert_slots(config, MOE, 1) == ((5, 6, 7, 0, 1), (), (5, 6, 7, 0, 1))
    assert rank_expert_slots(WorkerConfig(), MOE, 0) == ()


def test_init_expert_location_places_from_a_recorded_dump(tmp_path):
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"layers": [0, 2], "logical_count": [[500, 400, 300, 5, 5, 5, 5, 5]] * 2}))
    config = WorkerConfig(tp_size=2, ep_size=2, ep_num_redundant_experts=2, init_expert_location=str(path))
    loc = initial_location(config, MOE)
    loads = torch.tensor([[500.0, 400, 300, 5, 5, 5, 5, 5]] * 2)
    balance = lambda per_rank: float((per_rank.max(1).values / per_rank.mean(1)).max())  # noqa: E731
    spread = ExpertLocation.spread(2, 8, 2, 2)
    assert not loc.same_as(spread) and balance(loc.rank_loads(loads)) < balance(spread.rank_loads(loads))
    path.write_text(json.dumps({"logical_count": [[1] * 8]}))  # one layer: the model has two
    with pytest.raises(ValueError, match="2 MoE layers of 8 experts"):
        initial_location(config, MOE)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an expert distribution dump"):
        initial_location(config, MOE)


def test_planned_moves_rebuild_the_new_placement_from_the_old():
    old = ExpertLocation.spread(2, 8, 2, 2)
    new = ExpertLocation.balanced(torch.tensor([[9.0, 1, 1, 1, 1, 1, 9, 9], [1.0, 9, 9, 1, 1, 1, 1, 9]]), 2, 2)
    rows = old.changed_rows(new)
    moves = plan_moves(old, new, rows)
    held = old.phy2log.clone()
    for m in moves:  # each slot gets the expert its source held before any move
        assert old.phy2log[m.row, m.src_rank * old.slots + m.src_slot] == new.phy2log[m.row, m.dst_rank * old.slots
                                                                                    + m.dst_slot]
        held[m.row, m.dst_rank * old.slots + m.dst_slot] = old.phy2log[m.row, m.src_rank * old.slots + m.src_slot]
    assert torch.equal(held[rows], new.phy2log[rows])
    assert all(m.stays for m in moves if old.phy2log[m.row, m.dst_rank * old.slots + m.dst_slot]
               == new.phy2log[m.row, m.dst_rank * old.slots + m.dst_slot])  # a slot that keeps its expert stays
    chunk = make_chunk(rows, moves, 2)
    crossing = [m for m in moves if m.src_rank != m.dst_rank]
    assert [m for post in chunk.posts for m in post] == crossing and all(len(p) <= 2 for p in chunk.posts)


def test_the_recorder_counts_routed_tokens_and_dumps_a_recording(tmp_path):
    rec = ExpertLoadRecorder([0, 2], 4)
    rec.record(0, torch.tensor([[0, 1], [0, 3]]))
    with pytest.raises(ValueError, match="start a recording first"):
        rec.dump()
    rec.start()
    rec.count_forward()
    rec.record(2, torch.tensor([[2, 1]]))
    rec.stop()
    rec.record(2, torch.tensor([[3, 3]]))  # after the stop: in the totals only
    dump = rec.dump()
    assert dump.logical_count == [[0, 0, 0, 0], [0, 1, 1, 0]] and dump.forwards == 1 and not dump.recording
    assert dump.seconds == rec.dump().seconds  # a stopped recording's length is frozen
    assert rec.total.counts.tolist() == [[2, 1, 0, 1], [0, 1, 1, 2]]
    path = tmp_path / "dump.json"
    path.write_text(dump.to_json())
    assert ExpertDump.load(str(path)).logical_count == dump.logical_count
    rec.reset_window()
    assert int(rec.window.counts.sum()) == 0 and int(rec.total.counts.sum()) == 8


@pytest.mark.parametrize("flags, message", [
    (dict(tp_size=2, ep_size=3), "must equal --tp-size"),
    (dict(tp_size=2, pp_size=2, ep_size=2), "one-stage group"),
    (dict(enable_eplb=True), "give --ep-size > 1"),
    (dict(enable_two_batch_overlap=True, ep_num_redundant_experts=2), "give --ep-size > 1"),
    (dict(tp_size=2, ep_size=2, ep_num_redundant_experts=-1), "--ep-num-redundant-experts must be >= 0"),
    (dict(tp_size=2, ep_size=2, eplb_rebalance_num_iterations=0), "--eplb-rebalance-num-iterations"),
    (dict(tp_size=2, ep_size=2, eplb_rebalance_weights_per_pass=0), "--eplb-rebalance-weights-per-pass"),
])
def test_expert_parallel_flags_that_cannot_work_are_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**flags)
