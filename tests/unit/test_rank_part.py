"""A worker group rank loads only its part of the checkpoint (services/worker/parallel/rank_part.py):
the loaders cut each tensor as they read it, dense or a GGUF's quantized blocks, and what they keep
equals the whole checkpoint cut afterwards. The blocks are cut in their packed layout
(QuantWeight.row_slice / column_slice) and dequantize to the same slices of the dense weights.
No processes: the parts are compared with each other and with the whole."""
from __future__ import annotations

import gguf
import pytest
import torch

from bench.common.quant_blocks import random_blocks
from kernels.quant_gemv import QuantWeight
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.parallel.rank_part import RankPart
from tests.unit.tiny_gguf import write_gguf
from tests.unit.tiny_models import save_tiny

Q8_0, Q4_1 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
TP2_PP2 = [(rank, 2, 2) for rank in range(4)]  # (global rank, tp, pp)


def _blocks(rows: int, cols: int, qtype: str = "Q4_1") -> QuantWeight:
    if qtype == "int8":
        return QuantWeight.int8_per_channel(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)))
    return QuantWeight.from_blocks(torch.from_numpy(random_blocks(qtype, rows, cols, seed=1)), qtype)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K", "int8"])
def test_quantized_blocks_cut_in_their_packed_layout_dequantize_to_the_dense_slices(qtype):
    w = _blocks(12, 512, qtype)
    full = w.dequantize()  # [12, 512]
    assert torch.equal(w.column_slice(256, 128).dequantize(), full[:, 256:384])
    assert torch.equal(w.row_slice(4, 5).dequantize(), full[4:9])
    padded = w.row_slice(8, 6).dequantize()  # rows 8..11, then two rows past the end
    assert torch.equal(padded[:4], full[8:]) and not padded[4:].any()


def test_a_column_cut_inside_a_group_of_32_is_refused():
    with pytest.raises(ValueError, match="do not fall on groups of 32"):
        _blocks(4, 128).column_slice(16, 64)


def test_a_tp_size_that_cuts_the_blocks_inside_a_group_is_refused_by_name(tmp_path):
    _, hf = save_tiny(tmp_path / "hf", "mistral_no_window")  # intermediate 96: 48 columns of down_proj per rank
    path = write_gguf(hf, str(tmp_path / "m.gguf"), Q8_0)
    with pytest.raises(ValueError, match=r"cuts the quantized blocks of down_proj \(48 columns per rank\)"):
        load_checkpoint(path, "gguf", part=lambda full: RankPart(full, 0, 2, 1))


def _nbytes(tensors: dict) -> int:
    return sum(t.nbytes if isinstance(t, QuantWeight) else t.numel() * t.element_size() for t in tensors.values())


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], QuantWeight):
            assert a[name].qtype == b[name].qtype
            for field in ("qs", "d", "m"):
                x, y = getattr(a[name], field), getattr(b[name], field)
                assert (x is None and y is None) or torch.equal(x, y), (name, field)
        else:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("name", ["phi3", "qwen3_moe", "qwen3_gqa_tied_wide_heads"])
def test_an_hf_directory_loads_each_ranks_part_as_the_whole_cut_afterwards(tmp_path, name):
    """Phi-3's fused qkv and gate_up, a sparse MoE's per-expert tensors, a tied head; TP 2 x PP 2."""
    path, _ = save_tiny(tmp_path, name)
    whole = load_checkpoint(path)
    for rank, tp, pp in TP2_PP2:
        part = RankPart(whole.config, rank, tp, pp)
        loaded = load_checkpoint(path, part=lambda full: RankPart(full, rank, tp, pp))
        assert loaded.part == part and loaded.config == whole.config
        _same(loaded.tensors, part.take(whole.tensors))
        assert _nbytes(loaded.tensors) < 0.6 * _nbytes(whole.tensors)  # a quarter of the layers' weights, and the rest


@pytest.mark.parametrize("name, qtype", [("mistral_no_window", Q8_0), ("phi3", Q4_1), ("qwen3_moe", None)])
def test_a_gguf_loads_each_ranks_part_of_its_blocks_with_no_dense_copy(tmp_path, name, qtype):
    """Q/K rows permuted by llama.cpp (Mistral, one KV head replicated over TP 2), Phi-3's fused
    attn_qkv and ffn_up, Qwen3-MoE's stacked [E, I, H] experts (F32)."""
    _, hf = save_tiny(tmp_path / "hf", name, **({"intermediate_size": 128} if qtype else {}))
    path = write_gguf(hf, str(tmp_path / f"{name}.gguf"), qtype)
    mode = "gguf" if qtype else "auto"
    whole = load_checkpoint(path, mode)
    assert bool(whole.quantized) == bool(qtype)
    for rank, tp, pp in TP2_PP2:
        part = RankPart(whole.config, rank, tp, pp)
        loaded = load_checkpoint(path, mode, part=lambda full: RankPart(full, rank, tp, pp))
        _same(loaded.tensors, part.take(whole.tensors))
        _same(loaded.quantized, part.take(whole.quantized))
        assert _nbytes(loaded.tensors) + _nbytes(loaded.quantized) < 0.6 * (
            _nbytes(whole.tensors) + _nbytes(whole.quantized))
        if qtype:  # the blocks only: nothing the file quantized is dense on the rank
            assert not set(loaded.tensors) & set(loaded.quantized)


def test_the_tp_ranks_blocks_of_a_row_parallel_weight_are_its_column_blocks(tmp_path):
    """o_proj's input columns go to the ranks by head: their blocks, dequantized side by side, are
    the whole weight's; the column-parallel q_proj's rows stack likewise."""
    _, hf = save_tiny(tmp_path / "hf", "mistral_no_window", intermediate_size=128)
    path = write_gguf(hf, str(tmp_path / "m.gguf"), Q8_0)
    whole = load_checkpoint(path, "gguf").quantized
    ranks = [load_checkpoint(path, "gguf", part=lambda full, r=r: RankPart(full, r, 2, 1)).quantized for r in (0, 1)]
    o, q = "model.layers.1.self_attn.o_proj.weight", "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([r[o].dequantize() for r in ranks], 1), whole[o].dequantize())
    assert torch.equal(torch.cat([r[q].dequantize() for r in ranks], 0), whole[q].dequantize())
