"""`radixmesh train-draft`'s entry point and its step (a): the target's answers to the prompt set,
generated on radixmesh's Engine (services/worker/speculative/train_draft.py is the rest: the
features, the training and the eval). It lives here because the engine sits above the worker:
the worker's modules import no engine (pyproject.toml's import contracts).

The Engine runs in float32, whose greedy tokens are transformers' token for token, with every
prompt of a round queued at once so they share decode steps (--gen-batch running)."""
from __future__ import annotations

import queue
import random

from tqdm import tqdm

from services.common.outputs import FinishReason, RequestOutput
from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.speculative import train_draft
from services.worker.speculative.draft_data import copy_conversations


def main(argv: list[str]) -> int:
    return train_draft.main(argv, answer_prompts)


def answer_prompts(cfg: train_draft.TrainDraftConfig, model_path: str, tok) -> dict[str, tuple[list, list]]:
    """(a) on radixmesh's Engine in float32 -> {"train": (prompt ids, answers), "heldout": ...};
    the training sequences are every answer of every prompt, then the copy round's."""
    train, held = train_draft.read_prompts(cfg)
    encode = lambda messages: tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),  # noqa: E731
                                         add_special_tokens=False)
    engine = Engine(worker=WorkerConfig(model=model_path, dtype="float32", max_requests=cfg.gen_batch),
                    scheduler=SchedulerConfig(max_running_requests=cfg.gen_batch), tokenizer=tok)
    try:
        def answer(ids: list[list[int]], samples: int, desc: str) -> list[list[list[int]]]:
            return generate_answers(engine, ids, cfg.max_new_tokens, samples, cfg.sample_temperature, cfg.seed, desc)

        train_ids = [encode(m) for m in train]
        answers = answer(train_ids, cfg.samples_per_prompt, "(a) generating answers, train")
        prompts = [p for p, per in zip(train_ids, answers) for _ in per]
        outputs = [a for per in answers for a in per]
        if cfg.copy_prompts:
            texts = [(m, tok.decode(per[0])) for m, per in zip(train, answers)]
            copy_ids = [encode(m) for m in copy_conversations(texts, random.Random(cfg.seed))]
            prompts += copy_ids
            outputs += [per[0] for per in answer(copy_ids, 1, "(a) generating answers, copy round")]
        held_ids = [encode(m) for m in held]
        held_answers = [per[0] for per in answer(held_ids, 1, "(a) generating answers, heldout")]
    finally:
        engine.shutdown()
    return {"train": (prompts, outputs), "heldout": (held_ids, held_answers)}


def generate_answers(engine: Engine, prompt_ids: list[list[int]], max_new_tokens: int, samples: int, temperature: float,
                     seed: int, desc: str) -> list[list[list[int]]]:
    """Per prompt: its greedy answer, then `samples` - 1 sampled ones; an answer that stopped on
    EOS ends with it (the Engine returns the stop token, as transformers' generate does). All
    prompts are queued at once and batch in the Engine's decode steps; the bar counts finished
    answers."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    for i, ids in enumerate(prompt_ids):
        engine.submit(ids, greedy, lambda o, i=i: done.put((i, 0, o)))
        if samples > 1:
            sampled = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + i)
            engine.submit(ids, sampled, lambda o, i=i: done.put((i, 1 + o.index, o)), n=samples - 1)
    chunks: dict[tuple[int, int], list] = {}
    answers: list[list[list[int]]] = [[[] for _ in range(samples)] for _ in prompt_ids]
    with tqdm(total=len(prompt_ids) * samples, desc=desc, unit="answer") as bar:
        for _ in range(len(prompt_ids) * samples):
            while True:
                i, k, out = done.get(timeout=600)
                chunks.setdefault((i, k), []).append(out)
                if out.finished:
                    break
            whole = RequestOutput.joined(chunks.pop((i, k)))
            if whole.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"generating answer {k} of prompt {i} failed: {whole.error}")
            answers[i][k] = whole.token_ids
            bar.update(1)
    return answers
