"""Where each PEFT target module lives in our model, whose projections are fused.

PEFT names the unfused HF linears (`layers.3.self_attn.k_proj`); our Attention holds one
`qkv_proj` (rows q, then k, then v) and our MLP one `gate_up_proj` (rows gate, then up), in the
order load_decoder_tensors fuses the checkpoint. A module's LoRA delta therefore lands on a row
range of a fused linear's output; o_proj and down_proj are whole linears.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from services.worker.model.linear import Linear
from services.worker.model.llama import MLP, Attention

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = MODULES[:4]


@dataclass(frozen=True)
class Target:
    """One PEFT module: rows [lo, hi) of `linear`'s output, computed from its whole input."""

    linear: Linear
    lo: int
    hi: int

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.hi - self.lo


TargetKey = tuple[int, str]  # (layer index, PEFT module name)


def model_targets(model: nn.Module) -> dict[TargetKey, Target]:
    """Every (layer, module) of `model.layers` an adapter can target: dense attention and dense
    MLP blocks (a sparse MLP's experts are not Linears, so its layer has no gate/up/down)."""
    targets: dict[TargetKey, Target] = {}
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, Attention):
            q, kv = attn.q_size, attn.kv_size
            targets[i, "q_proj"] = Target(attn.qkv_proj, 0, q)
            targets[i, "k_proj"] = Target(attn.qkv_proj, q, q + kv)
            targets[i, "v_proj"] = Target(attn.qkv_proj, q + kv, q + 2 * kv)
            targets[i, "o_proj"] = Target(attn.o_proj, 0, attn.o_proj.out_features)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, MLP):
            inter = mlp.down_proj.in_features
            targets[i, "gate_proj"] = Target(mlp.gate_up_proj, 0, inter)
            targets[i, "up_proj"] = Target(mlp.gate_up_proj, inter, 2 * inter)
            targets[i, "down_proj"] = Target(mlp.down_proj, 0, mlp.down_proj.out_features)
    return targets
