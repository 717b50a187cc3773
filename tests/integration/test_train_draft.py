"""`radixmesh train-draft` end to end on a handful of prompts with the real default model: it shows
progress, writes a head EagleHead.load reads back, reports an acceptance length, and a rerun
with --resume reuses the cached data and the last epoch's state. Its answers come from the
Engine in float32: the greedy ones are transformers' own, and the sampled ones repeat with the
seed."""
from __future__ import annotations

import json
import os

import pytest
import torch

from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.engine import draft_answers
from services.engine.draft_answers import generate_answers
from services.worker.speculative.eagle_head import EagleHead, HeadKV

pytestmark = pytest.mark.slow


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_train_draft_tiny_run(tmp_path, capsys, model_path, one_thread):
    out, cache = tmp_path / "head", tmp_path / "cache"
    argv = ["--model", model_path, "--output", str(out), "--cache-dir", str(cache), "--num-prompts", "4",
            "--eval-prompts", "2", "--max-new-tokens", "16", "--epochs", "1", "--draft-vocab-size", "256",
            "--intermediate-size", "64", "--threads", "1"]
    assert draft_answers.main(argv) == 0
    err = capsys.readouterr().err  # tqdm's bars
    for stage in ("(a) generating answers, train", "(a) generating answers, copy round", "(b) features, train",
                  "(d) epoch 1/1", "(e) acceptance"):
        assert stage in err
    assert {"config.json", "model.safetensors", "eval.json"} <= set(os.listdir(out))
    assert {"data.pt", "train_state.pt"} <= set(os.listdir(cache))
    report = json.loads((out / "eval.json").read_text())
    assert report["acceptance_length"] >= 1 and report["verify_rounds"] > 0 and report["depth"] == 3

    data = torch.load(cache / "data.pt", weights_only=False)
    head = EagleHead.load(str(out), data["embed"], None, data["target"]["num_layers"])
    assert head.config.eagle3 and head.config.draft_vocab_size == 256 and head.config.capture_layers == (2, 15, 27)
    seq = data["heldout"][0]
    with torch.no_grad():
        logits, hidden = head.step(head.embed(seq["tokens"][1:].long()), head.fuse(seq["aux"][:-1].float()),
                                   torch.arange(len(seq["tokens"]) - 1), HeadKV.empty(head.config, torch.float32))
    assert logits.shape == (len(seq["tokens"]) - 1, 256) and torch.isfinite(logits).all()

    assert draft_answers.main(argv + ["--epochs", "2", "--resume"]) == 0
    printed = capsys.readouterr()
    assert "reusing" in printed.out and "resuming after epoch 1" in printed.out
    assert "(d) epoch 2/2" in printed.err and "(d) epoch 1/2" not in printed.err


def test_answers_are_the_targets_greedy_tokens_then_seeded_samples(model_path, checkpoint, tokenizer, hf_model):
    messages = [[{"role": "user", "content": "Name three colours."}],
                [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
                 {"role": "user", "content": "And 3 + 3?"}]]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True), add_special_tokens=False)
           for m in messages]
    engine = Engine(worker=WorkerConfig(model=model_path, dtype="float32", max_requests=8),
                    scheduler=SchedulerConfig(max_running_requests=8), checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        first = generate_answers(engine, ids, 40, 3, 0.8, 5, "answers")
        again = generate_answers(engine, ids, 40, 3, 0.8, 5, "answers")
    finally:
        engine.shutdown()
    eos = tokenizer.eos_token_ids
    for prompt, answers in zip(ids, first):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=eos,
                                    pad_token_id=eos[0])[0, len(prompt):].tolist()
        assert answers[0] == ref  # greedy, its EOS included when it stopped on one
        assert len(answers) == 3 and all(answers[1:])
    assert any(a[-1] in eos for per in first for a in per)  # a stop on EOS keeps the EOS, as transformers does
    assert first == again  # the sampled answers follow the seed
