"""Every adapter the worker cannot run exactly is refused with an AdapterError naming the
problem, before it reaches the model; so are unloading an adapter in use and requests naming
an adapter that is not loaded."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.common.random_adapter import make_random_adapter
from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepPlan
from services.worker.config import WorkerConfig
from services.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from tests.unit.lora_fixtures import lora_runner, save_tiny_llama
from tests.unit.tiny_models import save_tiny

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_refusals")
    path, hf = save_tiny_llama(root / "base")
    good = make_random_adapter(hf, str(root / "good"), 8, 16)
    _, wide = save_tiny_llama(root / "wide", hidden_size=96)
    wrong_model = make_random_adapter(wide, str(root / "wrong_model"), 8, 16)
    return SimpleNamespace(runner=lora_runner(path, max_lora_rank=8), good=good, wrong_model=wrong_model, hf=hf,
                           path=path)


def _config(d: str, **changes) -> None:
    with open(os.path.join(d, CONFIG_FILE)) as f:
        config = json.load(f)
    with open(os.path.join(d, CONFIG_FILE), "w") as f:
        json.dump({**config, **changes}, f)


def _tensors(d: str, edit) -> None:
    full = os.path.join(d, WEIGHTS_FILE)
    tensors = load_file(full)
    edit(tensors)
    save_file(tensors, full)


def _rename(old: str, new: str):
    return lambda t: t.__setitem__(new, t.pop(old))


# case → (how to spoil a copy of a good adapter directory, what the error says)
CASES = {
    "no_config": (lambda d: os.remove(os.path.join(d, CONFIG_FILE)), "has no adapter_config.json"),
    "bin_weights": (lambda d: os.rename(os.path.join(d, WEIGHTS_FILE), os.path.join(d, "adapter_model.bin")),
                    "only safetensors weights are read"),
    "bad_json": (lambda d: open(os.path.join(d, CONFIG_FILE), "w").write("{r: 8"), "is not valid JSON"),
    "json_list": (lambda d: open(os.path.join(d, CONFIG_FILE), "w").write("[8]"), "must hold a JSON object"),
    "bad_weights": (lambda d: open(os.path.join(d, WEIGHTS_FILE), "wb").write(b"junk"),
                    "not a readable safetensors file"),
    "not_lora": (lambda d: _config(d, peft_type="PREFIX_TUNING"), "peft_type 'PREFIX_TUNING' is not supported"),
    "target_lm_head": (lambda d: _config(d, target_modules=["q_proj", "lm_head"]),
                       r"target modules \['lm_head'\] are not supported"),
    "target_regex": (lambda d: _config(d, target_modules=".*proj"), "regular expressions are not supported"),
    "embedding_tensor": (lambda d: _tensors(d, _rename(f"{Q0}.lora_A.weight",
                                                       "base_model.model.model.embed_tokens.lora_embedding_A")),
                         "embed_tokens.lora_embedding_A' is not a LoRA weight of a supported module"),
    "rank_too_big": (lambda d: _config(d, r=16), "rank 16 exceeds --max-lora-rank 8"),
    "bad_rank": (lambda d: _config(d, r="8"), "r must be a positive integer"),
    "rank_pattern": (lambda d: _config(d, rank_pattern={"q_proj": 4}), r"per-module ranks \(rank_pattern\)"),
    "alpha_pattern": (lambda d: _config(d, alpha_pattern={"q_proj": 4}), r"per-module alphas \(alpha_pattern\)"),
    "bias": (lambda d: _config(d, bias="all"), "bias 'all' is not supported"),
    "modules_to_save": (lambda d: _config(d, modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    "dora": (lambda d: _config(d, use_dora=True), r"DoRA \(use_dora\) is not supported"),
    "lora_bias": (lambda d: _config(d, lora_bias=True), "LoRA biases"),
    "layer_beyond": (lambda d: _tensors(d, lambda t: [_rename(f"{Q0}.lora_{x}.weight",
                                                              f"{Q0.replace('.0.', '.5.')}.lora_{x}.weight")(t)
                                                      for x in "AB"]),
                     "weights for layer 5, but the base model has 2 layers"),
    "missing_b": (lambda d: _tensors(d, lambda t: t.pop(f"{Q0}.lora_B.weight")), "layer 0 q_proj has no lora_B"),
    "undeclared_module": (lambda d: _config(d, target_modules=["q_proj", "k_proj"]),
                          r"weights for down_proj in layer 0, which target_modules \[.k_proj., .q_proj.\] "
                          "does not list"),
    "rank_mismatch": (lambda d: _tensors(d, lambda t: t.__setitem__(f"{Q0}.lora_A.weight", torch.zeros(4, 64))),
                      r"lora_A \(4, 64\) and lora_B \(64, 8\), but the base model needs \(8, 64\)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused(tiny, tmp_path, case):
    runner, good = tiny.runner, tiny.good
    spoil, message = CASES[case]
    d = str(tmp_path / case)
    shutil.copytree(good, d)
    spoil(d)
    with pytest.raises(AdapterError, match=message):
        runner.loras.load(case, d)
    assert case not in runner.loras


def test_refused_missing_dir_bad_name_and_wrong_model(tiny, tmp_path):
    runner, good, wrong_model = tiny.runner, tiny.good, tiny.wrong_model
    with pytest.raises(AdapterError, match="does not exist"):
        runner.loras.load("x", str(tmp_path / "nowhere"))
    with pytest.raises(AdapterError, match="adapter name 'a@b' must be"):
        runner.loras.load("a@b", good)
    with pytest.raises(AdapterError, match=r"layer 0 down_proj has lora_A \(8, 96\) and lora_B \(96, 8\), "
                                          r"but the base model needs \(8, 96\) and \(64, 8\).*another model"):
        runner.loras.load("x", wrong_model)
    assert isinstance(AdapterError("x"), ValueError)


def test_refused_on_a_sparse_mlp(tmp_path):
    """Qwen3-MoE: gate/up/down of a sparse layer are experts, not linears this worker adapts."""
    path, moe = save_tiny(tmp_path / "moe", "qwen3_moe")
    attention_only = make_random_adapter(moe, str(tmp_path / "attn"), 4, 8, target_modules=("q_proj", "o_proj"))
    with pytest.raises(ValueError, match="no nn.Linear named"):
        make_random_adapter(moe, str(tmp_path / "none"), 4, 8, target_modules=("gate_proj",))
    runner = lora_runner(path)
    runner.loras.load("attn", attention_only)  # attention modules are fine
    dense = str(tmp_path / "dense")
    shutil.copytree(attention_only, dense)
    _config(dense, target_modules=["q_proj", "o_proj", "gate_proj"])
    _tensors(dense, lambda t: t.update({
        "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight": torch.zeros(32, 4)}))
    with pytest.raises(AdapterError, match="no dense gate_proj in layer 0"):
        runner.loras.load("dense", dense)


def test_registry_refusals(tiny, tmp_path):
    runner, good, hf = tiny.runner, tiny.good, tiny.hf
    info = runner.loras.load("good", good)
    assert runner.loras.load("good", good) == info  # the same files again: a no-op
    other = make_random_adapter(hf, str(tmp_path / "other"), 8, 16, seed=7)
    with pytest.raises(AdapterError, match="'good' is loaded already .* unload it first"):
        runner.loras.load("good", other)
    sp = SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="LoRA adapter 'missing' is not loaded on this worker"):
        runner.execute(StepPlan(0, [NewRequestSpec("r", [1, 2], [], sp, 0, adapter="missing")]))
    runner.execute(StepPlan(1, [NewRequestSpec("r", [1, 2], [], sp, 0, adapter="good")]))
    with pytest.raises(AdapterError, match="'good' is in use by a running request"):
        runner.loras.unload("good")
    runner.execute(StepPlan(2, released_rids=["r"]))
    runner.loras.unload("good")
    with pytest.raises(AdapterError, match="no adapter named 'good' is loaded"):
        runner.loras.unload("good")


@pytest.mark.parametrize("paths,message", [(("a",), "must be NAME=PATH"), (("=p",), "must be NAME=PATH"),
                                           (("a=p", "a=q"), "names must be distinct")])
def test_config_refuses_bad_lora_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(lora_paths=paths)
    with pytest.raises(ValueError, match="--max-loras must be >= 0"):
        WorkerConfig(max_loras=-1)
    with pytest.raises(ValueError, match="--lora-paths needs --max-loras >= 1"):
        WorkerConfig(max_loras=0, lora_paths=("a=p",))
    assert WorkerConfig(lora_paths=("a=b=c",)).lora_adapters == (("a", "b=c"),)


def test_lora_serving_off(tiny):
    """--max-loras 0: no manager, no hooks, requests naming an adapter refused."""
    runner = lora_runner(tiny.path, max_loras=0)
    assert runner.loras is None and runner.max_loras == 0
    with pytest.raises(ValueError, match="LoRA adapter 'good' is not loaded on this worker"):
        runner.execute(StepPlan(0, [NewRequestSpec("r", [1, 2], [], SamplingParams(), 0, adapter="good")]))
