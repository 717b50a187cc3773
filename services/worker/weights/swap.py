"""The swap: staged parameters into the live model, then everything derived from them redone.

A runner computes with more than its parameters: oneDNN-prepacked copies of the linears
(Linear.packed), the checkpoint's quantized blocks (Linear.quant) and the one-call decode stack
built on them (model.decode_stack), which the backend's attach set up. After the copy this
redoes what ModelRunner.__init__ did after loading, in the same order (prepack when the config
asks, then attach), so the runner computes exactly as one freshly started on the new weights:

- the blocks of a GGUF update are handed out again (attach → model.use_quantized) and the stack
  rebuilt on them;
- a model holding only quantized weights (--quantization gguf / int8) takes the staged ones
  (staging.py: a gguf model needs the update's GGUF blocks, an int8 one requantizes);
- an update without blocks (HF tensors) drops the old ones from every linear
  (Linear.set_quant(None, 0)) and the stack with them: the runner runs dense, op by op, as a
  runner started from an HF checkpoint does (one_call_rows, decode_stack, verify_rows 0).

The copy is in place (Tensor.copy_, same shape, dtype and device: it cannot fail half-way), so
a tied LM head (Linear.sharing the embedding's parameter) stays tied, and nothing else that
holds the parameters needs to know. The KV pool is not touched: the scheduler flushes caches.
"""
from __future__ import annotations

import torch

from services.worker.loader.checkpoint import Checkpoint
from services.worker.model.linear import Linear
from services.worker.weights.staging import StagedWeights


def swap_in(runner, staged: StagedWeights, source: str) -> int:
    """Copy staged parameters into runner.model, hand its quantized-only modules their new
    weights (staged.quant_only), re-derive its compute copies and bump runner.weights_version
    → the new version."""
    from services.worker.model.weight_bytes import resident_weight_bytes
    from services.worker.model.weight_format import apply_plan
    live = dict(runner.model.named_parameters())
    with torch.no_grad():
        for name, new in staged.params.items():
            live[name].copy_(new)
    if staged.quant_only:
        from kernels import quant_gemv
        apply_plan(runner.model, staged.quant_only, quant_gemv.load())
    if runner.config.prepack_weights and runner.device.type == "cpu":  # as __init__ decides it
        runner.prepacked = runner.model.prepack_weights()
    reattach(runner, Checkpoint(config=runner.model_config, tensors={}, source=source, quantized=staged.quantized))
    runner.weights_version = runner.weights_version + 1
    runner.weight_bytes = resident_weight_bytes(runner.model)
    return runner.weights_version


def reattach(runner, checkpoint: Checkpoint) -> None:
    """Drop every linear's quantized blocks and the decode stack, then let the backend attach to
    the model again with `checkpoint`'s blocks (none: dense), and take its answer as __init__ does."""
    model = runner.model
    for m in model.modules():
        if isinstance(m, Linear) and not m.quant_only:  # quantized-only ones hold their (new) blocks
            m.set_quant(None, 0)
    model.decode_stack, model.decode_stack_rows = None, 0
    runner.attach_backend(checkpoint)
