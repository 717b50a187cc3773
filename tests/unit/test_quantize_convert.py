"""`radixmesh quantize` on a tiny random Llama written as llama.cpp would (F32 GGUF): each type's
file keeps every metadata key, stores each tensor in the type formats.tensor_type picks, reads back
(gguf.quants.dequantize) close to the source within the type's bound, and loads in our loader with
logits close to the source's."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.cli import main as cli_main
from services.common.gguf_reader import FastGGUFReader
from services.common.sampling_params import SamplingParams
from services.quantize.formats import tensor_type
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from tests.unit.tiny_gguf import write_gguf

# Relative RMS error of the re-encoded 2-D weights (N(0, 0.02) init); Q8_0 embedding.
BOUNDS = {"Q8_0": 0.006, "Q4_0": 0.1, "Q4_1": 0.085, "Q5_0": 0.05, "Q5_1": 0.042, "Q4_K": 0.08, "Q5_K": 0.04,
          "Q6_K": 0.02, "F16": 1e-3, "BF16": 5e-3}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-layer Llama with 256-wide rows (k-quants apply to every 2-D weight), as an F32 GGUF."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)).eval()
    return write_gguf(hf, str(tmp_path_factory.mktemp("src") / "tiny.gguf"))


def _tensors(path: str) -> dict[str, tuple[str, np.ndarray]]:
    reader = FastGGUFReader(path)
    return {t.name: (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1))
            for t in reader.tensors}


def _logits(path: str) -> torch.Tensor:
    from services.worker.model_runner import ModelRunner
    runner = ModelRunner(WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=1 << 20, max_requests=2),
                         load_checkpoint(path))
    ids = list(range(3, 40))
    plan = StepPlan(0, [NewRequestSpec("r", ids, [], SamplingParams(), 0)],
                    [StepItem("r", ids, 0, list(range(10)), reset_pages=True, sample=False)])
    return runner.prefill_logits(plan)


@pytest.mark.parametrize("qtype", sorted(BOUNDS))
def test_each_type_reads_back_close_and_loads(source, tmp_path, qtype):
    out = str(tmp_path / f"tiny-{qtype}.gguf")
    assert cli_main(["quantize", "--model", source, "--out", out, "--type", qtype]) == 0
    src, dst = FastGGUFReader(source), FastGGUFReader(out)
    for key, f in src.fields.items():  # every key but the file type, unchanged
        if f.types and key != "general.file_type" and not key.startswith("GGUF."):
            assert dst.fields[key].contents() == f.contents(), key
    before, after = _tensors(source), _tensors(out)
    assert before.keys() == after.keys()
    for name, (kind, data) in after.items():
        expected = "F32" if name.endswith("norm.weight") else "Q8_0" if name == "token_embd.weight" else qtype
        assert kind == expected, name
        ref = before[name][1]
        bound = BOUNDS.get(kind, 0.0)
        err = np.sqrt(((data - ref) ** 2).mean() / (ref ** 2).mean())
        assert err <= bound, (name, kind, err)
    # Our loader reads it; logits move by about the weights' error (the Q8_0 embedding's at least), not more.
    ref_logits, got = _logits(source), _logits(out)
    rel = ((got - ref_logits).norm() / ref_logits.norm()).item()
    assert rel < 4 * max(BOUNDS[qtype], BOUNDS["Q8_0"]), rel


def test_types_follow_llama_cpp_fallbacks():
    assert tensor_type("blk.0.attn_norm.weight", (576,), "Q4_K", "Q8_0") == "F32"
    assert tensor_type("token_embd.weight", (49152, 576), "Q4_K", "Q8_0") == "Q8_0"
    assert tensor_type("token_embd.weight", (49152, 576), "Q4_K", "Q6_K") == "Q8_0"  # 576: no whole super-block
    assert tensor_type("blk.0.ffn_down.weight", (576, 1536), "Q4_K", "Q8_0") == "Q4_K"
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "Q4_K", "Q8_0") == "Q5_0"
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "Q5_K", "Q8_0") == "Q5_1"
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "Q6_K", "Q8_0") == "Q8_0"
    assert tensor_type("blk.0.attn_q.weight", (8, 20), "Q4_0", "Q8_0") == "F16"  # no whole block of 32
    # Q4_K_M: attn_v / ffn_down at Q6_K in the first and last eighth and every third layer between.
    more = [i for i in range(30) if tensor_type(f"blk.{i}.ffn_down.weight", (576, 1536), "Q4_K_M", "Q8_0", 30) == "Q6_K"]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert tensor_type("blk.4.ffn_down.weight", (576, 1536), "Q4_K_M", "Q8_0", 30) == "Q4_K"
    assert tensor_type("blk.0.attn_v.weight", (192, 576), "Q4_K_M", "Q8_0", 30) == "Q8_0"  # Q6_K's fallback
    assert tensor_type("blk.4.attn_v.weight", (192, 576), "Q5_K_M", "Q8_0", 30) == "Q5_1"
    assert tensor_type("output.weight", (256, 1024), "Q4_K_M", "Q8_0", 30) == "Q6_K"


def test_q4_k_m_mix(source, tmp_path):
    out = str(tmp_path / "tiny-Q4_K_M.gguf")
    assert cli_main(["quantize", "--model", source, "--out", out, "--type", "Q4_K_M"]) == 0
    kinds = {name: kind for name, (kind, _) in _tensors(out).items()}
    assert kinds["token_embd.weight"] == "Q6_K"
    assert kinds["blk.0.attn_v.weight"] == kinds["blk.0.ffn_down.weight"] == kinds["blk.0.attn_q.weight"] == "Q4_K"
    assert kinds["blk.1.attn_v.weight"] == kinds["blk.1.ffn_down.weight"] == "Q6_K"  # the last eighth of 2
    assert FastGGUFReader(out).fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert _logits(out).isfinite().all()


def test_refusals(source, tmp_path):
    from services.quantize.cli import QuantizeConfig, convert
    with pytest.raises(ValueError, match="--out is required"):
        QuantizeConfig(model=source)
    with pytest.raises(ValueError, match="--type must be one of"):
        QuantizeConfig(model=source, out="x.gguf", type="Q3_K")
    with pytest.raises(ValueError, match="--embedding-type must be one of"):
        QuantizeConfig(model=source, out="x.gguf", embedding_type="Q4_K_M")
    with pytest.raises(ValueError, match="must differ"):
        convert(QuantizeConfig(model=source, out=source))
