"""The EAGLE / EAGLE-3 draft head on random tiny heads: the math against a plain reference, the KV
cache (incremental = full, rollback, attend masks), the training unroll against inference
drafting, d2t, and the SGLang checkpoint format (names, config, round trip, errors)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.speculative.eagle_head import EagleHead, EagleHeadConfig, HeadKV, default_attend, needs_mask
from services.worker.speculative.train_draft import unroll

L = 8  # the tiny target's decoder layers
V, T = 100, 32  # the target's vocabulary and hidden size (the head's too: it embeds with the target's table)


def make_config(eagle3: bool = True, **kw) -> EagleHeadConfig:
    base = dict(eagle3=eagle3, hidden_size=T, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, vocab_size=V,
                draft_vocab_size=20 if eagle3 else V, target_hidden_size=T,
                capture_layers=(2, L // 2, L - 3) if eagle3 else (L,))
    return EagleHeadConfig(**{**base, **kw})


def make_head(eagle3: bool = True, seed: int = 0, **kw) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    c = make_config(eagle3, **kw)
    embed = torch.randn(V, c.hidden_size, generator=g)
    head = EagleHead(c, embed, None if eagle3 else torch.randn(V, T, generator=g) * 0.1,
                     None if eagle3 else 1 + 0.1 * torch.randn(T, generator=g))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    if eagle3:
        ids = torch.randperm(V, generator=g)[: c.draft_vocab_size].sort().values
        head.d2t.copy_(ids - torch.arange(c.draft_vocab_size))
        head.t2d[ids] = True
    return head.eval()


def inputs(head: EagleHead, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n,), generator=g)
    width = len(head.config.capture_layers) * T if head.config.eagle3 else T
    return head.embed(ids), head.fuse(torch.randn(n, width, generator=g)), torch.arange(n)


# --- the math -----------------------------------------------------------------------------------
def rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference(head: EagleHead, embeds, hidden, positions):
    """EAGLE-3 / EAGLE-1 over a whole sequence, causal, written out with HF's RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    c, sd = head.config, {k: v for k, v in head.state_dict().items()}
    p = "midlayer." if c.eagle3 else "layers.0."
    if c.eagle3:
        x = torch.cat([rms(embeds, sd[p + "input_layernorm.weight"]), rms(hidden, sd[p + "hidden_norm.weight"])], -1)
        residual = hidden
    else:
        x = residual = torch.cat([embeds, hidden], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    n = x.shape[0]
    q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(n, c.num_attention_heads, c.head_dim).transpose(0, 1)
    k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim).transpose(0, 1)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
    ang = torch.cat([positions[:, None].float() * inv] * 2, -1)
    q, k = apply_rotary_pos_emb(q[None], k[None], ang.cos()[None], ang.sin()[None])
    group = c.num_attention_heads // c.num_key_value_heads
    k, v = k[0].repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q[0] @ k.transpose(1, 2) / c.head_dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
    h = residual + attn @ sd[p + "self_attn.o_proj.weight"].T
    z = rms(h, sd[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(z @ sd[p + "mlp.gate_proj.weight"].T) * (z @ sd[p + "mlp.up_proj.weight"].T))
    out = h + mlp @ sd[p + "mlp.down_proj.weight"].T
    logits = rms(out, sd["norm.weight"]) @ sd["lm_head.weight"].T if c.eagle3 else out @ head.target_lm_head.T
    return logits, out


@pytest.mark.parametrize("eagle3", [True, False])
def test_step_matches_a_plain_reference(eagle3):
    head = make_head(eagle3)
    embeds, hidden, positions = inputs(head, 7)
    with torch.no_grad():
        logits, out = head.step(embeds, hidden, positions + 3, HeadKV.empty(head.config, torch.float32))
        ref_logits, ref_out = reference(head, embeds, hidden, positions + 3)
    assert logits.dtype == torch.float32
    assert logits.shape == (7, head.config.draft_vocab_size) and out.shape == (7, head.config.hidden_size)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_fuse():
    head = make_head(True)
    aux = torch.randn(5, 3 * T)
    torch.testing.assert_close(head.fuse(aux), aux @ head.fc.weight.T)
    e1 = make_head(False)
    x = torch.randn(5, T)  # EAGLE-1's feature: the stream before the target's final norm, normed here
    torch.testing.assert_close(e1.fuse(x), rms(x, e1.target_norm))


# --- the cache -----------------------------------------------------------------------------------
@pytest.mark.parametrize("eagle3", [True, False])
def test_incremental_steps_equal_the_whole_sequence(eagle3):
    head = make_head(eagle3)
    embeds, hidden, positions = inputs(head, 10)
    with torch.no_grad():
        full = head.step(embeds, hidden, positions, HeadKV.empty(head.config, torch.float32))
        cache, parts = HeadKV.empty(head.config, torch.float32), []
        for a, b in [(0, 3), (3, 4), (4, 10)]:
            parts.append(head.step(embeds[a:b], hidden[a:b], positions[a:b], cache))
    assert len(cache) == 10 and cache.k.shape == (10, 2, 8) and cache.positions.tolist() == list(range(10))
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), full[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), full[1], rtol=1e-5, atol=1e-5)


def test_keep_rolls_back_the_cache():
    head = make_head()
    embeds, hidden, positions = inputs(head, 8)
    with torch.no_grad():
        cache = HeadKV.empty(head.config, torch.float32)
        head.step(embeds[:5], hidden[:5], positions[:5], cache)
        head.step(embeds[:3], hidden[:3], torch.tensor([5, 6, 7]), cache)  # drafts the target rejects
        cache.keep(5)
        assert len(cache) == 5 and cache.positions.tolist() == [0, 1, 2, 3, 4]
        again = head.step(embeds[5:], hidden[5:], positions[5:], cache)
        full = head.step(embeds, hidden, positions, HeadKV.empty(head.config, torch.float32))
    torch.testing.assert_close(again[0], full[0][5:], rtol=1e-5, atol=1e-5)


def test_default_attend_mask():
    mask = default_attend(torch.tensor([0, 1, 2, 5]), torch.tensor([2, 3]))
    assert mask.tolist() == [[True, True, True, False, True, False],
                             [True, True, True, False, True, True]]


def test_a_single_query_builds_no_mask_only_when_it_follows_every_entry():
    """A chain's draft step and a decode's absorb skip the mask (all True); a query at a position
    the cache already reaches past (a recompute) still gets default_attend's."""
    assert not needs_mask(torch.tensor([0, 1, 2]), torch.tensor([3]))
    assert not needs_mask(torch.tensor([], dtype=torch.int64), torch.tensor([0]))
    assert needs_mask(torch.tensor([0, 1, 2]), torch.tensor([2]))
    assert needs_mask(torch.tensor([0, 1]), torch.tensor([2, 3]))
    head = make_head()
    embeds, hidden, positions = inputs(head, 7)
    with torch.no_grad():
        for query in (6, 3):  # after every entry; inside them (entries 3-5 must be hidden)
            cache = HeadKV.empty(head.config, torch.float32)
            head.step(embeds[:6], hidden[:6], positions[:6], cache)
            q = torch.tensor([query])
            explicit = default_attend(cache.positions, q)
            want = head.step(embeds[6:], hidden[6:], q, HeadKV(cache.k, cache.v, cache.positions), explicit)
            got = head.step(embeds[6:], hidden[6:], q, cache)
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_attend_mask_hides_entries():
    """Masking old entries out equals a cache that never held them."""
    head = make_head()
    embeds, hidden, positions = inputs(head, 6)
    with torch.no_grad():
        cache = HeadKV.empty(head.config, torch.float32)
        head.step(embeds[:4], hidden[:4], positions[:4], cache)
        attend = torch.tensor([[True, False, True, False, True, False], [True, False, True, False, True, True]])
        masked = head.step(embeds[4:], hidden[4:], positions[4:], cache, attend)
        # an entry's K/V depend on its own input only: a cache of entries 0 and 2 alone
        small = HeadKV(cache.k[[0, 2]], cache.v[[0, 2]], cache.positions[[0, 2]])
        plain = head.step(embeds[4:], hidden[4:], positions[4:], small)
    torch.testing.assert_close(masked[0], plain[0], rtol=1e-5, atol=1e-5)


def test_training_unroll_attends_as_chain_drafting_does():
    """train_draft's TTT unroll (all chains at once, attend masks) gives each chain's step s the
    logits a drafter gets by running the chain on a cache of true entries + its own drafts."""
    head = make_head()
    g = torch.Generator().manual_seed(3)
    seqs = [{"tokens": torch.randint(0, V, (n,), generator=g).to(torch.int32), "prompt_len": 5,
             "aux": torch.randn(n, 3 * T, generator=g), "next_ids": torch.randint(0, V, (n,), generator=g)}
            for n in (7, 5)]
    to_draft = torch.arange(V)
    with torch.no_grad():
        steps = unroll(head, seqs, 3, to_draft)
        s, offset = seqs[1], 6  # the second sequence's entries follow the first's 6
        feat, tokens = head.fuse(s["aux"]), s["tokens"].long()
        for p in range(1, len(tokens) - 3):  # chains with all three steps in the sequence (p = 0: no loss, skipped)
            cache = HeadKV.empty(head.config, torch.float32)
            logits, hidden = head.step(head.embed(tokens[1:p + 2]), feat[:p + 1], torch.arange(p + 1), cache)
            chain = [logits[-1]]
            hidden = hidden[-1:]
            for j in (1, 2):  # teacher-forced chain: embeds the true next token, as training does
                logits, hidden = head.step(head.embed(tokens[p + j + 1:p + j + 2]), hidden, torch.tensor([p + j]), cache)
                chain.append(logits[-1])
            for j, (logits, _, rows, _) in enumerate(steps):
                torch.testing.assert_close(logits[rows.tolist().index(offset + p)], chain[j], rtol=1e-4, atol=1e-4)


def test_to_target_ids():
    head = make_head()
    ids = head.to_target_ids(torch.arange(20))
    assert ids.tolist() == sorted(ids.tolist()) and head.t2d[ids].all() and int(head.t2d.sum()) == 20
    assert make_head(False).to_target_ids(torch.tensor([3, 7])).tolist() == [3, 7]


# --- the checkpoint ------------------------------------------------------------------------------
EAGLE3_NAMES = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
    f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("eagle3", [True, False])
def test_save_load_round_trip(tmp_path, eagle3):
    head = make_head(eagle3)
    head.save(str(tmp_path), dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    if eagle3:
        assert set(state) == EAGLE3_NAMES
        assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
        assert state["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q/k/v take 2H
        assert state["fc.weight"].shape == (32, 3 * T)
    else:
        assert "fc.bias" in state and "layers.0.self_attn.q_proj.weight" in state
        assert not any("input_layernorm" in k or "lm_head" in k for k in state)
    lm_head = None if eagle3 else head.target_lm_head
    loaded = EagleHead.load(str(tmp_path), head.embed_tokens, lm_head, L, target_norm=None if eagle3 else head.target_norm)
    assert loaded.config == head.config
    embeds, hidden, positions = inputs(head, 5)
    with torch.no_grad():
        a = head.step(embeds, hidden, positions, HeadKV.empty(head.config, torch.float32))
        b = loaded.step(embeds, hidden, positions, HeadKV.empty(head.config, torch.float32))
    torch.testing.assert_close(a, b)
    head.save(str(tmp_path / "bf16"))  # the default: bfloat16 tensors, integer d2t kept
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["lm_head.weight" if eagle3 else "fc.weight"].dtype \
        == torch.bfloat16
    half = EagleHead.load(str(tmp_path / "bf16"), head.embed_tokens, lm_head, L, dtype=torch.bfloat16)
    assert half.fc.weight.dtype == torch.bfloat16 and (not eagle3 or torch.equal(half.d2t, head.d2t))


def test_config_json_is_sglangs():
    d = make_config().to_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["draft_vocab_size"] == 20
    assert d["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # SGLang captures before id + 1
    assert d["tie_word_embeddings"] is False and d["num_hidden_layers"] == 1 and d["target_hidden_size"] == T
    assert EagleHeadConfig.from_dict(d, L) == make_config()
    del d["eagle_config"]  # SGLang's default without ids: before layers 2, L // 2, L - 3
    assert EagleHeadConfig.from_dict(d, 30).capture_layers == (2, 15, 27)
    e1 = make_config(False).to_dict()
    assert e1["architectures"] == ["LlamaForCausalLMEagle"] and "eagle_config" not in e1
    assert EagleHeadConfig.from_dict(e1, L) == make_config(False)


def test_eagle1_ignores_an_input_layernorm_weight(tmp_path):
    head = make_head(False)
    head.save(str(tmp_path), dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["layers.0.input_layernorm.weight"] = torch.ones(T)  # EAGLE's own checkpoints carry it
    save_file(state, str(tmp_path / "model.safetensors"))
    EagleHead.load(str(tmp_path), head.embed_tokens, head.target_lm_head, L)


def _edit(tmp_path, config=None, tensors=None):
    make_head().save(str(tmp_path), dtype=torch.float32)
    if config:
        d = json.load(open(tmp_path / "config.json"))
        d.update(config)
        json.dump(d, open(tmp_path / "config.json", "w"))
    if tensors:
        state = load_file(str(tmp_path / "model.safetensors"))
        for k, v in tensors.items():
            if v is None:
                del state[k]
            else:
                state[k] = v
        save_file(state, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("change, message", [
    (dict(config={"architectures": ["LlamaForCausalLM"]}), "is not an EAGLE head"),
    (dict(config={"target_hidden_size": 48}), "hidden size 48"),
    (dict(config={"hidden_size": 48}), "its own: 48"),
    (dict(config={"vocab_size": 99}), "vocabulary 99"),
    (dict(tensors={"norm.weight": None}), "missing norm.weight"),
    (dict(tensors={"fc.weight": torch.zeros(32, 10)}), r"fc.weight has shape \[32, 10\], expected \[32, 96\]"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}), r"capture layers \[10\]"),
])
def test_bad_checkpoints_name_the_path_and_the_problem(tmp_path, change, message):
    path = _edit(tmp_path, **change)
    with pytest.raises(ValueError, match=message) as e:
        EagleHead.load(path, torch.randn(V, T), None, L)
    assert path in str(e.value)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="needs config.json and"):
        EagleHead.load(str(tmp_path / "nowhere"), torch.randn(V, T), None, L)
    make_head().save(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=str(tmp_path)):
        EagleHead.load(str(tmp_path), torch.randn(V, T), None, L)
    make_head(False).save(str(tmp_path / "e1"))
    with pytest.raises(ValueError, match="target's lm_head"):
        EagleHead.load(str(tmp_path / "e1"), torch.randn(V, T), None, L)


def test_the_shipped_head_loads_for_the_default_model():
    """The bundled SmolLM2-135M-Instruct head (its own embedding stand-in: no model load here)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "services", "worker", "speculative", "heads",
                        "smollm2-135m-instruct-eagle3")
    assert os.path.getsize(os.path.join(path, "model.safetensors")) < 12e6
    head = EagleHead.load(path, torch.zeros(49152, 576), None, 30, dtype=torch.bfloat16)
    c = head.config
    assert c.eagle3 and c.capture_layers == (2, 15, 27) and c.draft_vocab_size == 2048 and c.rope_theta == 100000
    ids = head.to_target_ids(torch.arange(2048))
    assert ids.unique().numel() == 2048 and 0 <= int(ids.min()) and int(ids.max()) < 49152
    assert torch.equal(head.t2d.nonzero()[:, 0], ids.sort().values)


def test_a_request_that_is_not_drafting_holds_a_bounded_backlog_and_drafts_as_before(monkeypatch):
    """Features of a request the scheduler does not ask to draft run through the head every
    PENDING_LIMIT rows instead of piling up; its next proposal is the one a drafter that kept them
    all pending makes."""
    from services.worker.speculative import eagle
    from services.worker.speculative.drafter import DraftRequest
    head, limit = make_head(), eagle.PENDING_LIMIT
    g = torch.Generator().manual_seed(3)
    n = 2 * limit + 40
    tokens = torch.randint(0, V, (n + 1,), generator=g).tolist()
    aux = torch.randn(n, len(head.config.capture_layers) * T, generator=g)
    drafts = []
    for bound in (limit, 10 ** 9):  # the shipped bound; a drafter that never catches up
        monkeypatch.setattr(eagle, "PENDING_LIMIT", bound)
        drafter = eagle.EagleDrafter(head, topk=1, num_steps=3, num_draft_tokens=3)
        drafter.admit("r", tokens[:1])
        for pos in range(n):  # one decode step each: its row observed, then its sampled token
            drafter.observe("r", pos, aux[pos:pos + 1])
            drafter.extend("r", [tokens[pos + 1]])
            assert len(drafter.streams["r"].pending_pos) <= bound
        if bound == limit:
            assert drafter.streams["r"].n_true >= 2 * (limit - 1)
        drafts.append(drafter.propose([DraftRequest("r", 3)]))
    assert drafts[0] == drafts[1] and len(drafts[0][0]) == 3
