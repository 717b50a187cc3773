"""An embedding held only as quantized blocks: a lookup dequantizes just the rows it reads.

With a tied LM head (SmolLM2) the embedding and the head are one tensor. Under
`--quantization gguf` (or int8) it stays in its quantized format: the head runs on the
blocks like any quantized Linear, and a lookup dequantizes the distinct token ids of the
step (a decode step of 64 requests: 64 rows of 49,152), never the whole table.

`weight` is a meta Parameter of the table's shape and the model's dtype: nothing dense is
resident; it keeps the parameter's name, shape and dtype for the code that asks (weight updates).
"""
from __future__ import annotations

import torch
from torch import nn

from services.worker.model.quant_parts import QuantLike, select_rows


class QuantEmbedding(nn.Module):
    """quant: [vocab, hidden] in a quantized format; dtype: the model's (the output dtype)."""

    def __init__(self, quant: QuantLike, dtype: torch.dtype):
        super().__init__()
        self.quant = quant
        self.num_embeddings, self.embedding_dim = quant.shape
        self.weight = nn.Parameter(torch.empty(quant.shape, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] int64 → [..., hidden] in the model's dtype."""
        flat = input_ids.reshape(-1)
        ids, inverse = torch.unique(flat, return_inverse=True)  # each distinct row dequantized once
        rows = select_rows(self.quant, ids.to(torch.int64)).dequantize()  # float32 [U, hidden]
        out = rows.to(self.weight.dtype)[inverse]  # [T, hidden]
        return out.reshape(*input_ids.shape, self.embedding_dim)
