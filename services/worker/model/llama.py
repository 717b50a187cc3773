"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/3, Phi-3, Mistral, Qwen3-MoE) over a paged KV pool.

The model never sees requests: it takes a flat token batch and one
`ForwardMeta` owned by the runner, and reaches KV only through the attention
backend. Projections are fused (qkv, gate_up) so each layer runs a few large
matmuls for the whole batch. Attention and MLP are blocks other architectures compose
(gemma2.py; a sparse MLP from moe.py in qwen3_moe.py).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from services.worker.model.config import ModelConfig
from services.worker.model.layer_attention import LayerAttention
from services.worker.model.layer_ops import LayerOps, TorchLayerOps, gelu_tanh_mul
from services.worker.model.linear import Linear
from services.worker.model.mla import MLAttention, drop_mtp_layers
from services.worker.model.quant_embedding import QuantEmbedding
from services.worker.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """Holds the weight; the math is the layer ops' (layer_ops.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Attention(nn.Module):
    """variant: this layer's scale / window / soft-cap for the backend (Gemma 2); None = the
    backend's own (scale head_dim ** -0.5, ModelConfig.sliding_window)."""

    def __init__(self, config: ModelConfig, layer_id: int, variant: LayerAttention | None = None):
        super().__init__()
        self.layer_id, self.variant = layer_id, variant
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        # Qwen3: RMSNorm over each head of q and of k, before RoPE; None: no norm (Llama).
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, meta, ops: LayerOps) -> torch.Tensor:
        # x [T, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv, ops)
        qkv = ops.rope_qk(qkv, meta.positions, rope.cos, rope.sin,
                          self.num_heads, self.num_kv_heads, self.head_dim)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.variant is None:
            out = meta.attention(self.layer_id, q, k, v)  # [T, H, D]
        else:
            out = meta.attention(self.layer_id, q, k, v, self.variant)
        return self.o_proj(out.reshape(T, self.q_size))

    def _norm_qk(self, qkv: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] → the same with every q and k head RMS-normalized (v untouched)."""
        T, D = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = ops.rms_norm(q.reshape(T * self.num_heads, D), self.q_norm.weight, self.q_norm.eps)  # [T H, D]
        k = ops.rms_norm(k.reshape(T * self.num_kv_heads, D), self.k_norm.weight, self.k_norm.eps)  # [T Hkv, D]
        return torch.cat([q.view(T, self.q_size), k.view(T, self.kv_size), v], dim=-1)


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one matmul. activation "silu"
    (SwiGLU, the layer ops') or "gelu_tanh" (GeGLU, Gemma). intermediate: None = the config's."""

    def __init__(self, config: ModelConfig, intermediate: int | None = None, activation: str = "silu"):
        super().__init__()
        inter = intermediate or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = Linear(inter, config.hidden_size, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        h = ops.silu_mul(gate_up) if self.activation == "silu" else gelu_tanh_mul(gate_up)  # [T, I]
        return self.down_proj(h)

    @staticmethod
    def fuse_hf(t: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        """Pop the checkpoint's gate_proj / up_proj under prefix ("layers.3.mlp.") → {gate_up_proj: [gate; up]}.
        Phi-3 stores gate_up_proj fused already: nothing to do then."""
        if f"{prefix}gate_up_proj.weight" in t:
            return {}
        gate, up = t.pop(f"{prefix}gate_proj.weight", None), t.pop(f"{prefix}up_proj.weight", None)
        if gate is None or up is None:  # held as the file's blocks (--quantization gguf), or missing: reported
            return {}
        return {f"{prefix}gate_up_proj.weight": torch.cat([gate, up], 0)}


class DecoderLayer(nn.Module):
    """mlp: the layer's MLP block (anything with forward(x, ops) and fuse_hf); None = a dense MLP.
    attention: the layer's attention block (forward(x, rope, meta, ops); DeepSeek's MLA); None = Attention."""

    def __init__(self, config: ModelConfig, layer_id: int, mlp: nn.Module | None = None,
                 attention: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention if attention is not None else Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding, meta,
                ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) → (x', residual'): the residual stream is summed lazily, so
        each add fuses with the norm that follows it. residual None = first layer."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn(h, rope, meta, ops)
        h, residual = ops.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp(h, ops), residual


class LlamaForCausalLM(nn.Module):
    """mlp_for_layer(config, i): layer i's MLP block (Qwen3-MoE's sparse ones); None = dense everywhere.
    attention_for_layer(config, i): layer i's attention block (DeepSeek's MLA); None = Attention."""

    def __init__(self, config: ModelConfig,
                 mlp_for_layer: Callable[[ModelConfig, int], nn.Module] | None = None,
                 attention_for_layer: Callable[[ModelConfig, int], nn.Module] | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, mlp_for_layer(config, i) if mlp_for_layer else None,
                         attention_for_layer(config, i) if attention_for_layer else None)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config)
        # Tied: None until tie_lm_head() (after loading), then a Linear on the embedding's parameter.
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self.ops: LayerOps = TorchLayerOps()  # the runner installs fused ones where it can
        # Small pure-decode steps as one C++ call (use_decode_stack); None: op by op.
        self.decode_stack = None
        self.decode_stack_rows = 0
        # Set when the model is one rank's part of a group (services/worker/parallel): the stack
        # bypasses the modules' hooks, so it sums and gathers through tensor_parallel itself, and
        # a pipeline stage (whose forward runs between sends) declines it.
        self.tensor_parallel = None  # tensor_parallel.GroupSums
        self.pipeline = None  # pipeline.StageForward, the stage's forward
        # EAGLE-3's draft head reads the residual stream at a few layers (set_aux_layers); off: ().
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None  # the last step's capture, [T, len(aux_layers) * hidden]
        self._aux_slots: dict[int, int] = {}  # layer -> its slot in aux_hidden
        self._aux_index: torch.Tensor | None = None  # aux_layers as int64 [n], for the decode stack

    def tie_lm_head(self) -> None:
        """A tied model computes logits through a Linear sharing the embedding's parameter, so
        prepacking and quantized blocks treat it like every other linear. Call once the weights
        are loaded and in their dtype (moving a meta module to a device unties parameters)."""
        if self.config.tie_word_embeddings:
            self.lm_head = Linear.sharing(self.embed_tokens.weight)

    def prepack_weights(self) -> bool:
        """Prepack every linear (the LM head included) for oneDNN when this dtype and device
        allow it (see linear.py). Call again after any weight change."""
        return prepack_linears(self)

    def use_quantized(self, quantized: dict, max_rows: int, kernel) -> int:
        """Hand each linear (and a tied LM head) the checkpoint's quantized blocks of its
        weight, fusing q/k/v and gate/up as the dense weights are (parts in different formats
        as quant_parts.QuantParts), for calls of at most max_rows rows (Linear.set_quant).
        quantized: HF name → QuantWeight. Linears that hold only their blocks (--quantization
        gguf/int8) keep them. Returns how many weights got blocks or hold them; the others
        stay dense."""
        from services.worker.model.quant_parts import fuse
        from services.worker.model.weight_format import linear_sources
        q = {k.removeprefix("model."): v for k, v in quantized.items()}
        given = 0
        sources = list(linear_sources(self))
        if self.config.tie_word_embeddings:
            sources.append((self.lm_head, ["embed_tokens.weight"]))
        for linear, names in sources:
            if linear.quant_only:
                given += len(names)
                continue
            parts = [q.get(n) for n in names]
            if all(p is not None for p in parts):
                linear.set_quant(fuse(parts), max_rows, kernel)
                given += len(parts)
            else:
                linear.set_quant(None, 0)
        return given

    def step_linears(self) -> list[Linear]:
        """Every layer's qkv, o, gate_up and down, in the order a step runs them (LM head not included;
        a sparse MLP's experts neither)."""
        return [lin for layer in self.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         *_dense_linears(layer.mlp))]

    def use_decode_stack(self, kernel, team_spin_us: int = 100, max_rows: int | None = None) -> bool:
        """Run pure-decode steps of at most quant_max_rows rows as one C++ call
        (kernels/decode_stack.py: the same row kernels as the fused ops, the paged decode
        attention and the quantized linears, with no Python between them). Needs every
        linear, the LM head included, on quantized blocks (use_quantized); False otherwise.
        The stack reads the weights it was built from: call again after changing them.
        team_spin_us: the step's loops run on a StepTeam whose idle helpers poll that long
        before sleeping (kernels/cpu/step_team.h); -1: on OpenMP. max_rows: at most this many rows
        (--quant-max-rows; linears held only quantized have no limit of their own). Declined (False) for a model
        whose math the stack lacks (decode_stack_refusal): the op-by-op path runs it."""
        from kernels.quant_gemv import QuantWeight
        from services.worker.model.weight_format import quant_only_refusal
        self.decode_stack, self.decode_stack_rows = None, 0
        if self.decode_stack_refusal() is not None or quant_only_refusal(self) is not None:
            return False
        blocks = self.step_linears() + [self.lm_head]
        if kernel is None or any(lin is None or not isinstance(lin.quant, QuantWeight) for lin in blocks):
            return False
        c = self.config
        stack = kernel.DecodeStack(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                   c.head_dim ** -0.5, self.rope.cos, self.rope.sin, team_spin_us)

        def add(lin: Linear) -> int:
            q = lin.quant
            return stack.add_linear(q.qs, q.d, q.m, q.code, lin.bias)

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(layer.input_layernorm.weight.detach(), add(attn.qkv_proj), add(attn.o_proj),
                            layer.post_attention_layernorm.weight.detach(), add(mlp.gate_up_proj),
                            add(mlp.down_proj))
        stack.set_head(self._stack_embedding(), self.norm.weight.detach(), add(self.lm_head))
        if self.tensor_parallel is not None:
            sums = self.tensor_parallel  # looked up per call: a wrapper set on comm later (a bench's timer) sees it
            stack.set_all_reduce(lambda partial: sums.comm.all_reduce(partial))
        rows = min(lin.quant_max_rows for lin in blocks)  # quantized-only linears take any count
        self.decode_stack, self.decode_stack_rows = stack, rows if max_rows is None else min(rows, max_rows)
        return True

    def decode_stack_refusal(self) -> str | None:
        """Why the one-call decode stack cannot run this model, or None when it can: the stack
        computes plain Llama attention, with no q/k norm and no sliding window, and dense MLPs."""
        if self.pipeline is not None:
            return "pipeline parallelism (a stage runs its layers between receiving and sending)"
        if self.config.is_mla:
            return "multi-head latent attention (DeepSeek)"
        if self.config.num_experts:
            return f"mixture-of-experts MLPs ({self.config.num_experts} experts)"
        if self.config.qk_norm:
            return "per-head q/k RMSNorm (Qwen3)"
        if self.config.sliding_window is not None:
            return f"sliding-window attention (window {self.config.sliding_window})"
        return None

    def decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                    rows: torch.Tensor, page_size: int, pool, logits_rows: torch.Tensor) -> torch.Tensor:
        """One token per request through the decode stack (use_decode_stack), KV written.
        input_ids, positions, rows [B] int64: request b's pages are page_table[rows[b]]
        ([N, P] int64). → float32 logits [len(logits_rows), vocab]. With aux layers set
        (set_aux_layers), aux_hidden holds every row's capture, as forward's."""
        tp = self.tensor_parallel  # a rank's shard: the module's hooks look its vocabulary rows up and sum them
        looked_up = tp is not None or isinstance(self.embed_tokens, QuantEmbedding)
        embedded = self.embed_tokens(input_ids) if looked_up else None
        aux = self._aux_buffer(input_ids.shape[0])  # [B, n hidden] float32, or None: no capture
        logits = self.decode_stack.forward(input_ids, positions, page_table, rows, page_size, pool.k, pool.v,
                                           logits_rows, embedded, self._aux_index if aux is not None else None,
                                           aux)  # [R, vocab rows of this rank]
        self.aux_hidden = aux
        return logits if tp is None else tp.gather_logits(logits)

    def _stack_embedding(self) -> torch.Tensor:
        """The table the decode stack looks token ids up in: the dense embedding, or, for one
        held only quantized (QuantEmbedding), none ([0, hidden]): decode_step looks the rows up."""
        if isinstance(self.embed_tokens, QuantEmbedding):
            return torch.empty(0, self.config.hidden_size, dtype=self.norm.weight.dtype)
        return self.embed_tokens.weight.detach()

    def unpack_weights(self) -> None:
        unpack_linears(self)

    def forward(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor | None = None):
        """input_ids [T] → logits [len(logits_indices), vocab] (float32).

        Only the rows that are sampled go through the LM head: a prefill chunk
        of 2,000 tokens needs one row of logits, not 2,000.
        """
        x, residual = self.embed(input_ids), None
        aux = self._aux_buffer(input_ids.shape[0])  # [T, n hidden] float32, or None: no capture
        for i, layer in enumerate(self.layers):
            if aux is not None:
                self._capture(aux, i, x, residual)
            x, residual = layer(x, residual, self.rope, meta, self.ops)
        if aux is not None:
            self._capture(aux, len(self.layers), x, residual)
        self.aux_hidden = aux
        if hidden_indices is not None:  # embeddings: (logits, the final norm's output of those rows)
            return self.head(x, residual, logits_indices), self.final_hidden(x, residual, hidden_indices)
        return self.head(x, residual, logits_indices)

    def aux_capture_refusal(self) -> str | None:
        """Why this model cannot capture aux hidden states (set_aux_layers), or None when it can.
        A tensor-parallel rank can: its attention and MLP outputs are summed over the group (the
        hooks, the stack's all-reduce), so every rank holds the whole residual stream. A pipeline
        stage cannot: it holds only its own layers' stream, and its forward is the stage's."""
        if self.pipeline is not None:
            return "pipeline parallelism (a stage holds only its own layers' residual stream)"
        return None

    def set_aux_layers(self, layers: tuple[int, ...]) -> None:
        """Capture, after every forward and decode_step, the residual stream entering each
        decoder layer in `layers` (HF's output_hidden_states[l]: 0 is the embedding;
        num_hidden_layers is the last layer's output, before the final norm) as aux_hidden:
        float32 [T, len(layers) * hidden], one row per input token in input order, the layers'
        columns in the order given. () turns it off (aux_hidden None after the next step): no
        cost then. ValueError for an index outside 0..num_hidden_layers, a repeated one, or a
        model that cannot (aux_capture_refusal)."""
        layers = tuple(int(i) for i in layers)
        last = len(self.layers)
        if layers and (why := self.aux_capture_refusal()) is not None:
            raise ValueError(f"aux hidden states (EAGLE-3) are not supported with {why}")
        bad = [i for i in layers if not 0 <= i <= last]
        if bad:
            raise ValueError(f"aux layers {bad} out of range: 0..{last} (0 the embedding, {last} the last "
                             "layer's output before the final norm)")
        if len(set(layers)) != len(layers):
            raise ValueError(f"aux layers {list(layers)} repeat a layer")
        self.aux_layers, self.aux_hidden = layers, None
        self._aux_slots = {i: j for j, i in enumerate(layers)}
        self._aux_index = torch.tensor(layers, dtype=torch.int64) if layers else None

    def _aux_buffer(self, rows: int) -> torch.Tensor | None:
        """A fresh capture of `rows` rows, float32 [rows, len(aux_layers) * hidden]; None when off.
        Fresh each step: the caller may keep the last one while the next step runs."""
        if not self.aux_layers:
            return None
        width = len(self.aux_layers) * self.config.hidden_size
        return torch.empty(rows, width, dtype=torch.float32, device=self.norm.weight.device)

    def _capture(self, aux: torch.Tensor, layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """aux's slot for `layer` <- the stream entering it, residual + x [T, hidden] (x alone at
        layer 0), summed as the layer's add_rms_norm sums it, and copied now: the fused ops update
        their inputs in place."""
        slot = self._aux_slots.get(layer)
        if slot is None:
            return
        stream = x if residual is None else residual + x
        H = self.config.hidden_size
        aux[:, slot * H:(slot + 1) * H].copy_(stream)

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The last layer's (x, residual) [T, hidden] → the final norm's float32 output of rows
        `indices` (HF's last hidden state)."""
        x, _ = self.ops.add_rms_norm(x[indices], residual[indices], self.norm.weight, self.norm.eps)
        return x.float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → the first layer's input [T, hidden]."""
        return self.embed_tokens(input_ids)

    def head(self, x: torch.Tensor, residual: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The last layer's (x, residual) [T, hidden] → float32 logits of the rows logits_indices."""
        x, residual = x[logits_indices], residual[logits_indices]
        x, _ = self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
        return self.lm_head.logits(x)

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        load_decoder_tensors(self, tensors)


def _dense_linears(mlp: nn.Module) -> tuple[Linear, ...]:
    return (mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, MLP) else ()


def prepack_linears(model: nn.Module) -> bool:
    return all([m.prepack() for m in model.modules() if isinstance(m, Linear)])


def unpack_linears(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, Linear):
            m.unpack()


def load_decoder_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into a decoder (model.layers[i].self_attn / .mlp, config), fusing
    q/k/v (unless the checkpoint stores them fused, as Phi-3's qkv_proj, in the same row order)
    and letting each MLP block fuse its own (MLP.fuse_hf, moe.SparseMoeBlock.fuse_hf). Raises on
    missing or unexpected names so a wrong checkpoint never half-loads silently. Parameters on
    the meta device are held as quantized blocks instead (services/worker/model/weight_format.py):
    they need no tensor, and one given is not copied."""
    own = dict(model.named_parameters())
    loaded: set[str] = set()

    def put(name: str, value: torch.Tensor) -> None:
        if name not in own:
            raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
        if own[name].shape != value.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model {tuple(own[name].shape)}")
        with torch.no_grad():
            own[name].copy_(value)
        loaded.add(name)

    t = {k.removeprefix("model."): v for k, v in tensors.items() if "rotary_emb" not in k}
    if model.config.is_mla:  # DeepSeek's MTP layers, past the decoder's: the NEXTN drafter reads them
        t = drop_mtp_layers(model.config, t)
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        if isinstance(layer.self_attn, MLAttention):
            for name, value in layer.self_attn.fuse_hf(t, f"{p}self_attn.", model.config.rope_interleave).items():
                put(name, value)
        for suffix in ("weight", "bias") if hasattr(layer.self_attn, "qkv_proj") else ():
            parts = [t.pop(f"{p}self_attn.{n}_proj.{suffix}", None) for n in "qkv"]
            if all(x is not None for x in parts):
                put(f"{p}self_attn.qkv_proj.{suffix}", torch.cat(parts, 0))
        for name, value in layer.mlp.fuse_hf(t, f"{p}mlp.").items():
            put(name, value)
    tied = model.config.tie_word_embeddings
    if "lm_head.weight" in t and not tied:
        put("lm_head.weight", t.pop("lm_head.weight"))
    t.pop("lm_head.weight", None)  # tied: identical to the embedding
    for name, value in t.items():
        put(name, value)
    missing = {n for n in set(own) - loaded if not own[n].is_meta}  # meta: held quantized only (weight_format.py)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} missing)")
