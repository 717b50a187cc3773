"""The NEXTN draft head (services/worker/speculative/nextn_head.py): a random tiny Llama whose
checkpoint gains a random DeepSeek-layout MTP layer (model.layers.{L}.*, num_nextn_predict_layers: 1).
The target loads and decodes as without it; NextNHead.step equals a straightforward float64
re-computation of the MTP formula over the whole sequence, run at once, in chunks on one cache, or
as branches under an attend mask; checkpoints without a usable MTP layer are refused by name; and
NEXTN drafting changes no output (greedy, and sampled at a fixed seed)."""
from __future__ import annotations

import gc
import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.tokenizer.text_tokenizer import load_tokenizer
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.speculative.eagle_head import HeadKV
from services.worker.speculative.nextn_head import load_nextn_head
from tests.unit.tiny_models import word_tokenizer

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 16, 64, 96, 3, 4, 2, 16
EPS, THETA = 1e-5, 10000.0
P = f"model.layers.{LAYERS}."
PROMPTS = [[3, 7, 5, 9, 3, 7, 5, 9, 3, 7], [1, 2, 3, 4, 5, 6], [11, 4, 11, 4, 11], [8, 8, 2, 9, 13, 6, 6, 1]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def mtp_tensors(gen: torch.Generator, with_head: bool = False) -> dict[str, torch.Tensor]:
    """A random Llama-style MTP layer under DeepSeek's names (norm weights near 1)."""
    shapes = {"enorm.weight": [HIDDEN], "hnorm.weight": [HIDDEN], "eh_proj.weight": [HIDDEN, 2 * HIDDEN],
              "input_layernorm.weight": [HIDDEN], "self_attn.q_proj.weight": [HEADS * HEAD_DIM, HIDDEN],
              "self_attn.k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
              "self_attn.v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
              "self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD_DIM], "post_attention_layernorm.weight": [HIDDEN],
              "mlp.gate_proj.weight": [INTER, HIDDEN], "mlp.up_proj.weight": [INTER, HIDDEN],
              "mlp.down_proj.weight": [HIDDEN, INTER], "shared_head.norm.weight": [HIDDEN]}
    if with_head:
        shapes["shared_head.head.weight"] = [VOCAB, HIDDEN]
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen)
        out[P + name] = 1 + 0.2 * t if len(shape) == 1 else 0.3 * t
    return out


def with_mtp(src: str, dst: str, extra: dict[str, torch.Tensor], declare: bool = True) -> str:
    """A copy of checkpoint `src` with `extra` tensors appended and num_nextn_predict_layers: 1."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = os.path.join(dst, "model.safetensors")
    save_file({**load_file(weights), **extra}, weights, metadata={"format": "pt"})
    if declare:
        cfg = os.path.join(dst, "config.json")
        with open(cfg) as f:
            d = json.load(f)
        with open(cfg, "w") as f:
            json.dump({**d, "num_nextn_predict_layers": 1}, f)
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                         initializer_range=0.35, tie_word_embeddings=False, rms_norm_eps=EPS, rope_theta=THETA)
    model = LlamaForCausalLM(config).eval()
    plain = str(tmp_path_factory.mktemp("plain"))
    model.save_pretrained(plain, safe_serialization=True)
    word_tokenizer(plain, VOCAB)
    gen = torch.Generator().manual_seed(1)
    mtp = mtp_tensors(gen)
    root = tmp_path_factory.mktemp("mtp")
    t = load_file(os.path.join(plain, "model.safetensors"))
    return {"plain": plain, "mtp": with_mtp(plain, str(root / "mtp"), mtp), "tensors": {**t, **mtp},
            "embed": t["model.embed_tokens.weight"], "lm_head": t["lm_head.weight"], "root": root, "gen": gen}


# --- the target -----------------------------------------------------------------------
def engine(path: str, algorithm: str | None = None, topk: int = 1) -> Engine:
    worker = WorkerConfig(dtype="float32", kv_cache_bytes=8 << 20, max_requests=64,
                          speculative_algorithm=algorithm, speculative_draft_model_path=path if algorithm else None,
                          speculative_num_steps=3, speculative_eagle_topk=topk, speculative_num_draft_tokens=6)
    return Engine(worker=worker, scheduler=SchedulerConfig(max_running_requests=64, speculative_cost_model="fixed",
                                                       speculative_row_cost=1e-6, speculative_disable_batch_size=1000),
                  checkpoint=load_checkpoint(path), tokenizer=load_tokenizer(path))


def run(e: Engine, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    try:
        return [o.token_ids for o in e.generate_batch(prompts, params)]
    finally:
        e.shutdown()
        gc.collect()


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    return run(engine(tiny["plain"]), [GREEDY] * len(PROMPTS))


def test_the_loader_skips_the_mtp_layer_and_the_target_decodes_as_without_it(tiny, plain_greedy):
    assert not [k for k in load_checkpoint(tiny["mtp"]).tensors if k.startswith(P)]
    assert run(engine(tiny["mtp"]), [GREEDY] * len(PROMPTS)) == plain_greedy


def test_undeclared_extra_layers_still_fail_the_target_load(tiny):
    stray = with_mtp(tiny["plain"], str(tiny["root"] / "stray"), mtp_tensors(tiny["gen"]), declare=False)
    with pytest.raises(ValueError, match=f"unknown parameter 'layers.{LAYERS}.eh_proj.weight'"):
        engine(stray)


# --- the head against the formula ---------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [n, heads, d]."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [n, d/2]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def reference(t: dict, lm_head: torch.Tensor, next_ids: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP formula in float64, all rows at once: hidden [n, H] the post-final-norm state,
    mask [n, n] (True: row may attend to row) -> (logits [n, V], out [n, H])."""
    w = {k.removeprefix(P): v.double() for k, v in t.items() if k.startswith(P)}
    n = next_ids.shape[0]
    embeds = t["model.embed_tokens.weight"].double()[next_ids]
    x = torch.cat([rms(embeds, w["enorm.weight"]), rms(hidden.double(), w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
    a = rms(x, w["input_layernorm.weight"])
    q = rotate((a @ w["self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), positions)
    k = rotate((a @ w["self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), positions)
    v = (a @ w["self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    h = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
    m = rms(h, w["post_attention_layernorm.weight"])
    h = h + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    out = rms(h, w["shared_head.norm.weight"])
    return out @ lm_head.double().T, out


@pytest.fixture(scope="module")
def seq(tiny):
    """A 10-entry sequence: the target's capture L (before its final norm) and the next tokens."""
    gen = torch.Generator().manual_seed(2)
    n = 10
    aux = 3 * torch.randn(n, HIDDEN, generator=gen)
    hidden = rms(aux.double(), tiny["tensors"]["model.norm.weight"].double())
    return {"aux": aux, "hidden": hidden, "next": torch.randint(0, VOCAB, (n,), generator=gen),
            "positions": torch.arange(n), "causal": torch.ones(n, n, dtype=torch.bool).tril()}


@pytest.fixture(scope="module")
def head(tiny):
    return load_nextn_head(tiny["mtp"], tiny["embed"], tiny["lm_head"], LAYERS, THETA)


def test_the_head_has_the_drafters_interface(head):
    c = head.config
    assert (c.eagle3, c.capture_layers, c.draft_vocab_size) == (False, (LAYERS,), VOCAB)
    assert len(HeadKV.empty(c, torch.float32)) == 0
    ids = torch.tensor([3, 15])
    assert torch.equal(head.to_target_ids(ids), ids)


def test_fuse_is_the_targets_final_norm(tiny, head, seq):
    torch.testing.assert_close(head.fuse(seq["aux"]).double(), seq["hidden"], atol=1e-5, rtol=1e-5)


def test_step_equals_the_formula_at_once_and_in_chunks(tiny, head, seq):
    ref_logits, ref_out = reference(tiny["tensors"], tiny["lm_head"], seq["next"], seq["hidden"], seq["positions"],
                                    seq["causal"])
    with torch.inference_mode():
        embeds, hidden = head.embed(seq["next"]), head.fuse(seq["aux"])
        cache = HeadKV.empty(head.config, torch.float32)
        logits, out = head.step(embeds, hidden, seq["positions"], cache)
        assert logits.dtype == torch.float32 and len(cache) == 10
        torch.testing.assert_close(logits.double(), ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-4, rtol=1e-4)
        cache, parts, start = HeadKV.empty(head.config, torch.float32), [], 0
        for size in (4, 1, 3, 2):
            rows = slice(start, start + size)
            parts.append(head.step(embeds[rows], hidden[rows], seq["positions"][rows], cache))
            start += size
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), out, atol=1e-5, rtol=1e-5)


def test_branches_under_an_attend_mask_equal_each_path_alone(tiny, head, seq):
    """Two candidates at position 6, each attending to entries 0..5 and itself (the drafter's tree
    rows), equal the formula over each path; their hidden is a previous step's out (chaining)."""
    t, lm = tiny["tensors"], tiny["lm_head"]
    with torch.inference_mode():
        cache = HeadKV.empty(head.config, torch.float32)
        _, out = head.step(head.embed(seq["next"][:6]), head.fuse(seq["aux"][:6]), seq["positions"][:6], cache)
        branch_ids = torch.tensor([5, 12])
        attend = torch.zeros(2, 8, dtype=torch.bool)
        attend[:, :6] = True
        attend[0, 6] = attend[1, 7] = True
        logits, _ = head.step(head.embed(branch_ids), out[5].expand(2, -1), torch.tensor([6, 6]), cache, attend)
    for row, tok in enumerate(branch_ids):
        ids = torch.cat([seq["next"][:6], tok.reshape(1)])
        hidden = torch.cat([seq["hidden"][:6], out[5:6].double()])
        ref, _ = reference(t, lm, ids, hidden, torch.arange(7), torch.ones(7, 7, dtype=torch.bool).tril())
        torch.testing.assert_close(logits[row].double(), ref[-1], atol=1e-4, rtol=1e-4)


def test_the_checkpoints_own_head_serves_when_the_targets_is_not_dense(tiny, seq):
    extra = mtp_tensors(torch.Generator().manual_seed(3), with_head=True)
    path = with_mtp(tiny["plain"], str(tiny["root"] / "own_head"), extra)
    head = load_nextn_head(path, tiny["embed"], None, LAYERS, THETA)
    t = {**load_file(os.path.join(tiny["plain"], "model.safetensors")), **extra}
    ref, _ = reference(t, extra[P + "shared_head.head.weight"], seq["next"], seq["hidden"], seq["positions"],
                       seq["causal"])
    with torch.inference_mode():
        logits, _ = head.step(head.embed(seq["next"]), head.fuse(seq["aux"]), seq["positions"],
                              HeadKV.empty(head.config, torch.float32))
    torch.testing.assert_close(logits.double(), ref, atol=1e-4, rtol=1e-4)


# --- refusals --------------------------------------------------------------------------
def test_refusals_name_the_path_and_the_reason(tiny):
    root, embed, lm = tiny["root"], tiny["embed"], tiny["lm_head"]
    with pytest.raises(ValueError, match="ships no MTP layer.*EAGLE3") as e:
        load_nextn_head(tiny["plain"], embed, lm, LAYERS, THETA)
    assert tiny["plain"] in str(e.value)
    declared_only = with_mtp(tiny["plain"], str(root / "declared_only"), {})
    with pytest.raises(ValueError, match=f"no model.layers.{LAYERS}.* tensors.*ships no MTP layer"):
        load_nextn_head(declared_only, embed, lm, LAYERS, THETA)
    gguf = root / "target.gguf"
    gguf.write_bytes(b"GGUF" + bytes(28))
    with pytest.raises(ValueError, match="target.gguf is a GGUF file"):
        load_nextn_head(str(gguf), embed, lm, LAYERS, THETA)
    with pytest.raises(ValueError, match="no shared_head.head.weight"):
        load_nextn_head(tiny["mtp"], embed, None, LAYERS, THETA)
    with pytest.raises(ValueError, match="hidden size"):
        load_nextn_head(tiny["mtp"], embed[:, :32], lm, LAYERS, THETA)
    with pytest.raises(ValueError, match="layers, the target"):
        load_nextn_head(tiny["mtp"], embed, lm, LAYERS + 1, THETA)
    mla = mtp_tensors(torch.Generator().manual_seed(4))
    mla[P + "self_attn.kv_a_proj_with_mqa.weight"] = mla.pop(P + "self_attn.k_proj.weight")
    with pytest.raises(ValueError, match="MLA"):
        load_nextn_head(with_mtp(tiny["plain"], str(root / "mla"), mla), embed, lm, LAYERS, THETA)


# --- end to end --------------------------------------------------------------------------
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_nextn_greedy_equals_plain(tiny, plain_greedy, topk):
    e = engine(tiny["mtp"], "NEXTN", topk)
    stats = e.scheduler.stats
    assert run(e, [GREEDY] * len(PROMPTS)) == plain_greedy
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # a random layer: drafts both ways


def test_nextn_sampled_at_a_seed_equals_plain(tiny):
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=8, ignore_eos=True) for s in range(8)]
    prompts = [PROMPTS[0]] * len(params)
    assert run(engine(tiny["mtp"], "NEXTN"), params, prompts) == run(engine(tiny["plain"]), params, prompts)
