"""One harness run from its config: build the worker's runner (or engine), measure, tear down."""
from __future__ import annotations

from services.common.model_path import resolve_model_path
from services.eval.agreement import AgreementResult, agreement, greedy_outputs, prompt_ids
from services.eval.config import AgreementConfig, PerplexityConfig
from services.eval.corpus import read_corpus
from services.eval.perplexity import PerplexityResult, perplexity
from services.worker.config import WorkerConfig


def corpus_tokens(model: str | None, corpus: str, max_tokens: int | None, tokenizer=None) -> list[int]:
    """The corpus's first max_tokens tokens under the model's tokenizer (no special tokens)."""
    from services.tokenizer.text_tokenizer import load_tokenizer
    tokenizer = tokenizer or load_tokenizer(resolve_model_path(model))
    ids = tokenizer.encode(read_corpus(corpus), add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids


def run_perplexity(cfg: PerplexityConfig, checkpoint=None, tokenizer=None) -> PerplexityResult:
    """`checkpoint`/`tokenizer`: reuse loaded ones (the bench measures many configurations)."""
    from services.worker.loader.checkpoint import load_checkpoint
    from services.worker.model_runner import ModelRunner
    path = resolve_model_path(cfg.worker.model)
    tokens = corpus_tokens(path, cfg.corpus, cfg.max_tokens, tokenizer)
    runner = ModelRunner(cfg.worker, checkpoint or load_checkpoint(path, cfg.worker.quantization))
    return perplexity(runner, tokens, cfg.window, cfg.stride, cfg.chunk)


def engine_outputs(worker: WorkerConfig, new_tokens: int, checkpoint=None, tokenizer=None) -> list[list[int]]:
    """Greedy outputs of the bundled prompts on an in-process Engine of `worker`'s flags."""
    from services.engine.engine import Engine
    engine = Engine(worker=worker, checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        return greedy_outputs(engine, prompt_ids(engine), new_tokens)
    finally:
        engine.shutdown()


def reference_worker(cfg: AgreementConfig) -> WorkerConfig:
    """The reference: --reference-model (default --model) in --reference-dtype, every other flag default
    but the pool's budget and threads."""
    return WorkerConfig(model=cfg.reference_model or cfg.worker.model, dtype=cfg.reference_dtype,
                        kv_cache_bytes=cfg.worker.kv_cache_bytes, num_threads=cfg.worker.num_threads)


def run_agreement(cfg: AgreementConfig, reference: list[list[int]] | None = None) -> AgreementResult:
    """`reference`: the reference's outputs when already computed (the bench shares them)."""
    if reference is None:
        reference = engine_outputs(reference_worker(cfg), cfg.new_tokens)
    candidate = engine_outputs(cfg.worker, cfg.new_tokens)
    return agreement(reference, candidate, cfg.new_tokens)
