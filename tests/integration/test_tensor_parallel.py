"""Tensor and pipeline parallelism over real processes joined by torch.distributed
(services/worker/parallel): a group of ranks computes the logits of a group of one, in float32,
within 1e-4, on a random tiny configuration of every registered architecture (TP 2 × PP 2; TP 2
and PP 2 alone on Llama) and on the default model (TP 3 × PP 2: greedy text and logprobs through
the Engine; TP 3 and PP 2 alone with n-gram speculation), and TP 3 on the file's quantized blocks with the one-call decode stack, each
rank loading only its part. A TP size the model cannot take is refused before
any process starts, and a rank that hangs fails the leader's step within the group's timeout
instead of hanging it."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.loader.checkpoint import load_checkpoint
from services.worker.model.registry import ARCHITECTURES
from services.worker.group.leader import create_runner, group_refusal
from services.worker.weights.errors import WeightUpdateError
from tests.unit.tiny_models import BASE, BATCHES, CONFIGS, logits_by_position, save_tiny, sequences

pytestmark = pytest.mark.slow

# One tiny configuration per registered architecture (Llama and Qwen2 below, the rest tiny_models').
PER_ARCHITECTURE = ["qwen3_gqa_tied_wide_heads", "phi3_window", "mistral_no_window", "gemma2", "qwen3_moe",
                    "mixtral", "deepseek_v3", "deepseek_v2_group_limited"]
EXTRA = {  # name → (transformers config class, model class, fields)
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "qwen2_bias_one_kv_head": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),  # replicated KV
}
ATOL = 1e-4


def _save(tmp_path, name: str) -> str:
    if name in CONFIGS:
        return save_tiny(tmp_path, name)[0]
    import transformers
    config_cls, model_cls, extra = EXTRA[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **extra})).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def _logits(path: str, tp: int, pp: int = 1, **flags) -> dict:
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4, tp_size=tp,
                          pp_size=pp, **flags)
    runner = create_runner(config, load_checkpoint(path))
    try:
        seqs = sequences("three_chunked")
        return logits_by_position(runner, seqs, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()}, 4)
    finally:
        runner.close()


def test_every_registered_architecture_has_a_configuration_here():
    covered = {CONFIGS[n][1] for n in PER_ARCHITECTURE} | {EXTRA[n][1] for n in EXTRA}
    assert covered == set(ARCHITECTURES)


@pytest.mark.parametrize("name", PER_ARCHITECTURE + list(EXTRA))
def test_tp2_pp2_gives_the_logits_of_one_rank_on_every_architecture(tmp_path, name):
    """TP 2 × PP 2 shards every architecture's layers both ways at once (each stage's heads,
    experts and vocabulary split over its two ranks); Llama also runs TP 2 and PP 2 alone. The
    other tests here run TP 2 alone on Llama and Qwen3-MoE, and PP 2 alone on the default model."""
    path = _save(tmp_path, name)
    one = _logits(path, 1)
    for tp, pp in ((2, 1), (1, 2), (2, 2)) if name == "llama_gqa" else ((2, 2),):
        group = _logits(path, tp, pp)
        for rid, rows in one.items():
            for (pos, a), (pos2, b) in zip(rows, group[rid], strict=True):
                assert pos == pos2
                torch.testing.assert_close(b, a, atol=ATOL, rtol=0,
                                           msg=lambda m: f"{name} tp {tp} pp {pp} {rid} position {pos}: {m}")
                assert int(a.argmax()) == int(b.argmax())


def test_a_closed_group_gives_the_calling_thread_its_cpus_and_torch_threads_back(tmp_path):
    """The leader pins its thread to its share of the CPUs and sets its torch threads while the
    group lives; the thread (the Engine's step thread, here the test's) outlives the group."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    _logits(_save(tmp_path, "llama_gqa"), 2)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


@pytest.mark.parametrize("all_reduce", ["shm", "gloo"])
def test_tp2_gives_the_same_logits_over_shared_memory_and_over_gloo(tmp_path, all_reduce):
    path = _save(tmp_path, "qwen3_moe")
    one, two = _logits(path, 1), _logits(path, 2, all_reduce=all_reduce)
    for rid, rows in one.items():
        for (_, a), (_, b) in zip(rows, two[rid], strict=True):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_tp2_with_an_fp8_kv_cache_equals_tp1_with_it(tmp_path):
    """Each rank's pool holds its own KV heads in FP8, each head rotated and scaled on its own."""
    path = _save(tmp_path, "llama_gqa")
    one, two = _logits(path, 1, kv_cache_dtype="fp8_e4m3"), _logits(path, 2, kv_cache_dtype="fp8_e4m3")
    for rid, rows in one.items():
        for (_, a), (_, b) in zip(rows, two[rid], strict=True):
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_tp2_serves_lora_adapters_as_peft_merges_them(tmp_path):
    """Adapters given at start and loaded at run time: each rank keeps B's rows of its column-parallel
    modules and A's columns of o and down; the mixed batch equals PEFT's merged models."""
    from tests.unit.lora_fixtures import assert_matches, make_random_adapter, merged, run_together, save_tiny_llama
    path, hf = save_tiny_llama(tmp_path / "base")
    dirs = {n: make_random_adapter(hf, str(tmp_path / n), 4, 9, seed=i + 1) for i, n in enumerate(("a", "b"))}
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=8 << 20, max_requests=8, tp_size=2,
                          lora_paths=(f"a={dirs['a']}",))
    runner = create_runner(config, load_checkpoint(path))
    try:
        runner.loras.load("b", dirs["b"])  # at run time: on every rank
        seqs = sequences("three_chunked")
        requests = {"a": (seqs["a"], "a"), "b": (seqs["b"], "b"), "c": (seqs["c"], "")}
        ours = run_together(runner, requests, {rid: c for rid, (_, c) in BATCHES["three_chunked"].items()})
        for rid, (tokens, adapter) in requests.items():
            ref = merged(hf, dirs[adapter]) if adapter else hf
            assert_matches(ours[rid], ref, tokens, f"tp2 {rid}", atol=ATOL)
        runner.loras.unload("b")
        assert "b" not in runner.loras
    finally:
        runner.close()


PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,"]


def _greedy(engine: Engine) -> list:
    sp = SamplingParams(temperature=0.0, max_new_tokens=10, logprobs=True)
    return [engine.generate(p, sp, timeout=300) for p in PROMPTS]


def test_tp3_pp2_on_the_default_model_generates_one_ranks_greedy_text_and_logprobs(checkpoint, tokenizer):
    """9 query heads and 3 KV heads over 3 ranks: 3 and 1 each; the vocabulary in 3 row blocks;
    30 layers in 2 stages of 15, six ranks. TP 3 and PP 2 alone run in the speculation test below
    (and TP 3 on the quantized blocks)."""
    outs = {}
    for tp, pp in ((1, 1), (3, 2)):
        engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=4, tp_size=tp,
                                            pp_size=pp), checkpoint=checkpoint, tokenizer=tokenizer)
        try:
            outs[tp, pp] = _greedy(engine)
        finally:
            engine.shutdown()
    for sizes, group in outs.items():
        for one, other in zip(outs[1, 1], group, strict=True):
            assert other.token_ids == one.token_ids and other.text == one.text, sizes
            diffs = [abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, other.logprobs, strict=True)]
            assert max(diffs) < ATOL, (sizes, diffs)


def test_tp3_on_the_files_quantized_blocks_runs_the_one_call_decode_stack_on_each_ranks_part(model_path, checkpoint,
                                                                                               tokenizer):
    """--quantization gguf: each rank loads only its part of the Q4_1/Q8_0 blocks (no dense copy),
    the one-call decode stack sums over the group; greedy text equals one rank's on the same blocks."""
    def engine(tp: int) -> Engine:
        config = WorkerConfig(dtype="float32", quantization="gguf", kv_cache_bytes=32 << 20, max_requests=4,
                              tp_size=tp)
        return (Engine(model_path, worker=config) if tp > 1  # the leader loads its own part too
                else Engine(worker=config, checkpoint=load_checkpoint(model_path, "gguf"), tokenizer=tokenizer))

    outs, weight_bytes = {}, {}
    for tp in (1, 3):
        eng = engine(tp)
        try:
            runner = eng.runner
            assert runner.decode_stack and runner.quantized_weights > 0
            weight_bytes[tp] = runner.weight_bytes
            outs[tp] = _greedy(eng)
            if tp > 1:  # each rank holds a slice: an update to the leader alone would break the group
                with pytest.raises(WeightUpdateError, match="not supported on a worker group"):
                    runner.update_weights_from_disk(model_path)
        finally:
            eng.shutdown()
    for one, group in zip(outs[1], outs[3], strict=True):
        assert group.token_ids == one.token_ids and group.text == one.text
        assert max(abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, group.logprobs, strict=True)) < ATOL
    # Every weight split three ways but the norms: the leader holds about a third.
    assert weight_bytes[3] < 0.36 * weight_bytes[1], weight_bytes


@pytest.mark.parametrize("sizes, message", [
    (dict(tp_size=2), "--tp-size 2 does not divide the model's 9 attention heads"),
    (dict(pp_size=31), "--pp-size 31 exceeds the model's 30 layers"),
])
def test_sizes_the_model_cannot_take_are_refused_before_any_rank_starts(checkpoint, tokenizer, sizes, message):
    with pytest.raises(ValueError, match=message):
        Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, **sizes), checkpoint=checkpoint,
               tokenizer=tokenizer)


def test_tp3_and_pp2_with_ngram_speculation_verify_drafts_on_every_rank_and_keep_one_ranks_text(checkpoint,
                                                                                               tokenizer):
    """Every rank drafts from the same accepted tokens, so all verify the same drafts in the same
    steps (under PP, split into micro-batches); the text is one rank's without speculation, and
    drafts were accepted."""
    import json
    from pathlib import Path
    copy_heavy = json.loads((Path(__file__).parents[2] / "bench" / "data" / "copy_heavy.json").read_text())[:2]
    sp = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    outs = {}
    for tp, pp, spec in ((1, 1, None), (3, 1, "NGRAM"), (1, 2, "NGRAM")):
        eng = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=4, tp_size=tp,
                                         pp_size=pp, pp_micro_batch_tokens=1, speculative_algorithm=spec),
                     scheduler=SchedulerConfig(speculative_cost_model="fixed"),  # drafts run at any step cost
                     checkpoint=checkpoint, tokenizer=tokenizer)
        try:
            outs[tp, pp] = eng.generate_batch([eng.prompt_ids(messages=c["messages"]) for c in copy_heavy], sp)
        finally:
            eng.shutdown()
    for sizes in ((3, 1), (1, 2)):
        assert [o.token_ids for o in outs[sizes]] == [o.token_ids for o in outs[1, 1]], sizes
        assert sum(o.spec_accepted_tokens for o in outs[sizes]) > 0, sizes


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantizations_made_from_each_ranks_slice_are_refused_by_name(quantization):
    why = group_refusal(WorkerConfig(tp_size=3, quantization=quantization))
    assert f"--quantization {quantization} is not supported" in why and "gguf, auto or none" in why


def test_a_hung_rank_fails_the_leaders_step_within_the_groups_timeout(tmp_path):
    from services.step.contract import NewRequestSpec, StepItem, StepPlan
    path = _save(tmp_path, "llama_gqa")
    config = WorkerConfig(dtype="float32", page_size=4, kv_cache_bytes=4 << 20, max_requests=4, tp_size=2,
                          dist_timeout_s=3.0)
    runner = create_runner(config, load_checkpoint(path))
    follower = runner.group.followers[0].proc
    try:
        sp = SamplingParams(temperature=0.0)
        runner.execute(StepPlan(0, [NewRequestSpec("a", [1, 2, 3], [], sp, 0)]))
        os.kill(follower.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises((RuntimeError, TimeoutError)):  # gloo's error, or the shared-memory wait's
            runner.execute(StepPlan(1, [], [StepItem("a", [1, 2, 3], 0, [0], True)]))
        assert time.monotonic() - started < 3.0 + 5.0
    finally:
        os.kill(follower.pid, signal.SIGCONT)
        runner.close()
    assert follower.poll() is not None  # closing the group ended the follower
