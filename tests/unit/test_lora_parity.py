"""LoRA adapters on our model equal PEFT's merged model (float32): all seven target modules at
ranks 8 and 16, lora_alpha != r, rsLoRA scaling, and a subset of modules; over prefill chunks and
decode steps, alone and in one batch with the base model."""
from __future__ import annotations

import pytest
import torch

from bench.common.random_adapter import make_random_adapter
from tests.unit.lora_fixtures import assert_matches, lora_runner, merged, run_together, save_tiny_llama

# name → (rank, alpha, target modules or None for all seven, use_rslora)
ADAPTERS = {"r8": (8, 16, None, False), "r16_rslora": (16, 8, None, True),
            "r4_subset": (4, 12, ("q_proj", "v_proj", "down_proj"), False)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parity")
    path, hf = save_tiny_llama(root / "base")
    dirs = {}
    for seed, (name, (rank, alpha, modules, rslora)) in enumerate(ADAPTERS.items()):
        kwargs = {"target_modules": modules} if modules else {}
        dirs[name] = make_random_adapter(hf, str(root / name), rank, alpha, seed=seed + 1, use_rslora=rslora,
                                         **kwargs)
    return path, hf, dirs


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_matches_peft_merge(tiny, name):
    path, hf, dirs = tiny
    runner = lora_runner(path, dirs)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (30,), generator=g).tolist()
    out = run_together(runner, {"x": (tokens, name), "base": (tokens, "")}, {"x": [13, 9], "base": [22]})
    reference = merged(hf, dirs[name])
    assert_matches(out["x"], reference, tokens, name)
    assert_matches(out["base"], hf, tokens, "base")
    with torch.no_grad():  # the adapter changes the logits well beyond the tolerance
        assert (reference(torch.tensor([tokens])).logits - hf(torch.tensor([tokens])).logits).abs().max() > 0.05


def test_scaling_and_info(tiny):
    _, _, dirs = tiny
    runner = lora_runner(tiny[0], dirs)
    infos = {i.name: i for i in runner.loras.infos()}
    assert infos["r8"].scaling == 2.0 and infos["r16_rslora"].scaling == 2.0  # 16 / 8; 8 / sqrt(16)
    assert infos["r4_subset"].target_modules == ("q_proj", "v_proj", "down_proj")
    assert infos["r8"].identity.startswith("r8@") and len(infos["r8"].identity) == len("r8@") + 12
    assert not any(i.resident for i in infos.values()) and runner.loras.max_loras == 4


def test_bfloat16_close_to_float32(tiny):
    """In bfloat16 (prepacked linears where the CPU allows) the deltas run in the model's dtype:
    logits within bfloat16's error of float32's, and as far from the base model's as those."""
    path, hf, dirs = tiny
    tokens = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(6)).tolist()
    requests, chunks = {"x": (tokens, "r16_rslora"), "base": (tokens, "")}, {"x": [21], "base": [21]}
    ours = {dtype: run_together(lora_runner(path, dirs, dtype=dtype), requests, chunks)
            for dtype in ("float32", "bfloat16")}
    for rid in requests:
        for (p, low), (_, full) in zip(ours["bfloat16"][rid], ours["float32"][rid]):
            assert (low - full).abs().max() <= 0.03 * full.abs().max(), f"{rid} position {p}"
    x32, base32 = ours["float32"]["x"][0][1], ours["float32"]["base"][0][1]
    x16, base16 = ours["bfloat16"]["x"][0][1], ours["bfloat16"]["base"][0][1]
    assert (x16 - base16).abs().max() > 0.5 * (x32 - base32).abs().max()
