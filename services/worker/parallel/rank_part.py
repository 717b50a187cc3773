"""The part of a checkpoint one rank of a worker group holds: its pipeline stage's layers
(renumbered from 0), then its tensor-parallel slice of each tensor (tensor_parallel.py).

A loader takes it tensor by tensor as it reads them (load_checkpoint's `part`), so a rank never
holds the whole checkpoint: only its part, and the one tensor being read. A GGUF's quantized
blocks are cut in their packed layout, with no dense copy (QuantWeight.row_slice/column_slice).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kernels.quant_gemv import QuantWeight
from services.worker.model.config import ModelConfig
from services.worker.parallel.dp_attention import DpAttentionShard
from services.worker.parallel.pipeline import PipelineStage
from services.worker.parallel.tensor_parallel import TensorShard, Weight


@dataclass(frozen=True)
class RankPart:
    """Global rank `rank` of a tp × pp group (placement.py's numbering: rank = stage · tp + tp_rank)."""
    full: ModelConfig
    rank: int
    tp: int
    pp: int
    expert_slots: tuple[tuple[int, ...], ...] = ()  # expert parallelism: TensorShard.expert_slots
    dp_attention: bool = False  # --enable-dp-attention: attention whole on every rank (dp_attention.py)

    def __post_init__(self) -> None:
        self.shard  # the sizes the model cannot take raise ValueError here, naming the flag

    # Derived once (a loader asks for them with every tensor it reads); not fields, so not compared.
    @cached_property
    def stage(self) -> PipelineStage | None:
        return PipelineStage(self.full, self.rank // self.tp, self.pp) if self.pp > 1 else None

    @cached_property
    def shard(self) -> TensorShard | DpAttentionShard | None:
        stage = self.stage
        if self.tp == 1:
            return None
        if self.dp_attention:
            return DpAttentionShard(self.full, self.rank, self.tp, self.expert_slots)
        return TensorShard(stage.config if stage else self.full, self.rank % self.tp, self.tp, self.expert_slots)

    @property
    def config(self) -> ModelConfig:
        """The model this rank builds."""
        stage, shard = self.stage, self.shard
        return shard.config if shard else stage.config if stage else self.full

    def take(self, tensors: dict[str, Weight]) -> dict[str, Weight]:
        """Some of the full checkpoint's HF-named tensors (dense, or a file's quantized blocks) →
        this rank's part of them: the tensors of its stage's layers and of no layer, sliced."""
        stage, shard = self.stage, self.shard
        if stage is not None:
            tensors = stage.tensors(tensors)
        if shard is not None and tensors:
            if any(isinstance(t, QuantWeight) for t in tensors.values()):
                why = shard.blocks_refusal()
                if why is not None:
                    raise ValueError(why)
            tensors = shard.tensors(tensors)
        return tensors
