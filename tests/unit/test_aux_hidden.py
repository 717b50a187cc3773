"""EAGLE-3's aux hidden states (LlamaForCausalLM.set_aux_layers): the residual stream entering
chosen decoder layers, captured on both CPU paths. The op-by-op forward's capture equals
transformers' output_hidden_states in float32; the one-call decode stack's equals the op-by-op
path's bit for bit (decodes, mixed requests, a verify item); logits are the same with capture
on and off; bad layer indices are refused clearly."""
from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.step.contract import NewRequestSpec, StepItem, StepPlan
from services.worker.config import WorkerConfig
from services.worker.model.config import ModelConfig
from services.worker.model.llama import LlamaForCausalLM
from services.worker.model_runner import ModelRunner

PROMPTS = {"a": [1, 9690, 198, 2683, 314, 253, 5356, 30, 2, 198, 1, 4093, 198],  # 13 tokens
           "b": [1, 4093, 198, 504, 1175, 282, 4649, 25, 28, 30, 2, 198, 1, 9690, 198, 2683, 314, 253, 5356, 30]}
PAGES = {"a": [0, 1, 2], "b": [3, 4, 5]}
LAYERS = (2, 15, 27, 30)  # 30: the default model's last layer's output, before the final norm
HIDDEN = 576


def _runner(checkpoint, dtype: str, stack: bool) -> ModelRunner:
    return ModelRunner(WorkerConfig(dtype=dtype, kv_cache_bytes=8 << 20, max_requests=4, quant_max_rows=2,
                                    decode_stack=stack), checkpoint)


def _prompts_plan(rids: list[str]) -> StepPlan:
    """The prompts' admission and prefill as one step (mixed requests: each its own rows)."""
    specs = [NewRequestSpec(r, PROMPTS[r], [], SamplingParams(temperature=0), 0) for r in rids]
    return StepPlan(0, specs, [StepItem(r, PROMPTS[r], 0, PAGES[r], True) for r in rids])


def _decode(runner: ModelRunner, rids: list[str], steps: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Prefill the prompts (op by op), then greedy-decode `steps` steps of the requests
    together → each step's (logits, model.aux_hidden)."""
    specs = [NewRequestSpec(r, PROMPTS[r], [], SamplingParams(temperature=0), 0) for r in rids]
    runner.execute(StepPlan(0, specs, [StepItem(r, PROMPTS[r], 0, PAGES[r], True) for r in rids]))
    pos = {r: len(PROMPTS[r]) for r in rids}
    out = []
    for step in range(1, steps + 1):
        plan = StepPlan(step, [], [StepItem(r, [runner.requests[r].output_ids[-1]], pos[r], []) for r in rids])
        logits, _ = runner.compute_logits(plan)
        out.append((logits, runner.model.aux_hidden))
        for r, row in zip(rids, logits):
            runner.requests[r].output_ids.append(int(row.argmax()))
            pos[r] += 1
    return out


def _toy() -> LlamaForCausalLM:
    return LlamaForCausalLM(ModelConfig(name="toy", vocab_size=64, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16))


def test_set_aux_layers_refuses_bad_indices_and_pipeline_stages():
    model = _toy()
    assert model.aux_layers == () and model.aux_hidden is None and model.aux_capture_refusal() is None
    for bad in ((5,), (-1,), (0, 9)):
        with pytest.raises(ValueError, match=r"out of range: 0\.\.4"):
            model.set_aux_layers(bad)
    with pytest.raises(ValueError, match="repeat"):
        model.set_aux_layers((1, 1))
    model.set_aux_layers((4, 0, 2))  # any order; 4: before the final norm
    assert model.aux_layers == (4, 0, 2)
    model.set_aux_layers(())
    assert model.aux_layers == ()
    model.pipeline = object()  # a pipeline stage holds only its own layers
    assert "pipeline parallelism" in model.aux_capture_refusal()
    with pytest.raises(ValueError, match="pipeline parallelism"):
        model.set_aux_layers((1,))
    model.set_aux_layers(())  # off is always fine


@torch.inference_mode()
def test_op_by_op_capture_equals_transformers_hidden_states(checkpoint, hf_model):
    """float32, both prompts in one step: each request's rows equal transformers'
    output_hidden_states[l] of its prompt (l = 30: the last layer's output, hooked, before the
    final norm); the logits are the same with capture on and off."""
    runner = _runner(checkpoint, "float32", stack=False)
    try:
        model = runner.model
        off = runner.prefill_logits(_prompts_plan(["a", "b"]))  # [13 + 20, V]
        assert model.aux_hidden is None
        runner.reset()
        model.set_aux_layers(LAYERS)
        on = runner.prefill_logits(_prompts_plan(["a", "b"]))
        aux = model.aux_hidden  # [13 + 20, 4 * 576]
    finally:
        runner.close()
    assert torch.equal(on, off)
    assert aux.dtype == torch.float32 and aux.shape == (33, len(LAYERS) * HIDDEN)
    final: list[torch.Tensor] = []  # the last HF layer's output: the stream before the final norm
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda module, args, out: final.append(out[0] if isinstance(out, tuple) else out))
    try:
        first = 0
        for r in ("a", "b"):
            n = len(PROMPTS[r])
            hidden = hf_model(torch.tensor([PROMPTS[r]]), output_hidden_states=True).hidden_states
            want = [hidden[i][0] for i in LAYERS[:-1]] + [final[-1].reshape(n, HIDDEN)]
            for j, (layer, w) in enumerate(zip(LAYERS, want)):
                got = aux[first:first + n, j * HIDDEN:(j + 1) * HIDDEN]
                err = float((got - w).abs().max() / w.abs().max())
                assert err < 1e-4, (r, layer, err)
            first += n
    finally:
        hook.remove()


@pytest.fixture(scope="module")
def bf16_runners(checkpoint):
    """(the one-call decode stack, op by op) on the file's quantized blocks, bfloat16 as served."""
    stacked, plain = _runner(checkpoint, "bfloat16", stack=True), _runner(checkpoint, "bfloat16", stack=False)
    assert stacked.model.decode_stack is not None and plain.model.decode_stack is None
    yield stacked, plain
    stacked.close()
    plain.close()


@torch.inference_mode()
def test_stack_capture_is_bit_identical_to_op_by_op(bf16_runners):
    """Decodes of one request and of two at different lengths (mixed rows, across a page
    boundary): the stack's capture and logits equal the op-by-op path's bit for bit; turning the
    capture off leaves the stack's logits as they were, and aux_hidden None."""
    stacked, plain = bf16_runners
    for runner in bf16_runners:
        runner.model.set_aux_layers(LAYERS)
    try:
        for rids, steps in ((["a"], 2), (["a", "b"], 3)):
            for runner in bf16_runners:
                runner.reset()
            got, want = _decode(stacked, rids, steps), _decode(plain, rids, steps)
            for step, ((g_logits, g_aux), (w_logits, w_aux)) in enumerate(zip(got, want)):
                assert g_aux.shape == (len(rids), len(LAYERS) * HIDDEN) and g_aux.dtype == torch.float32
                assert torch.equal(g_aux, w_aux), (rids, step, float((g_aux - w_aux).abs().max()))
                assert torch.equal(g_logits, w_logits), (rids, step)
        stacked.model.set_aux_layers(())
        stacked.reset()
        off = _decode(stacked, ["a", "b"], 3)
        assert all(torch.equal(o, g[0]) and aux is None for (o, aux), g in zip(off, got))
    finally:
        for runner in bf16_runners:
            runner.model.set_aux_layers(())


@torch.inference_mode()
def test_a_verify_items_capture_equals_decoding_its_tokens_one_by_one(bf16_runners):
    """A verify item [last, d1..d5] (six rows of one page-table row, consecutive positions) beside
    another request's decode, as one stack call: its seven rows of capture, in input order, equal
    the op-by-op path's one-token steps' rows, bit for bit, the layers in the order asked."""
    stacked, plain = bf16_runners
    order = (30, 0, 15)  # any order; 0: the embedding
    for runner in bf16_runners:
        runner.model.set_aux_layers(order)
        runner.reset()
    try:
        steps = _decode(plain, ["a", "b"], 6)  # op by op, one token at a time
        decoded = list(plain.requests["a"].output_ids)
        stacked.execute(_prompts_plan(["a", "b"]))
        first = stacked.requests["a"].output_ids[-1]
        assert first == decoded[0]
        plan = StepPlan(1, [], [StepItem("a", [first] + decoded[1:6], len(PROMPTS["a"]), [], verify=True),
                                StepItem("b", [stacked.requests["b"].output_ids[-1]], len(PROMPTS["b"]), [])])
        assert stacked._one_call(plan, [stacked.requests["a"], stacked.requests["b"]]) is not None  # the stack's
        logits, _ = stacked.compute_logits(plan)
        aux = stacked.model.aux_hidden  # [7, 3 * 576]
        assert torch.equal(logits[:6], torch.stack([s[0][0] for s in steps]))
        assert aux.shape == (7, len(order) * HIDDEN)
        assert torch.equal(aux[:6], torch.stack([s[1][0] for s in steps]))  # a's row of each one-token step
        assert torch.equal(aux[6], steps[0][1][1])  # b's first decode
        embedded = stacked.model.embed_tokens(torch.tensor([first] + decoded[1:6])).float()
        assert torch.equal(aux[:6, HIDDEN:2 * HIDDEN], embedded)  # slot 1 is layer 0: the embedding
    finally:
        for runner in bf16_runners:
            runner.model.set_aux_layers(())
