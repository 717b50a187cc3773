"""What one successful weight update did and cost (the admin RPC's WeightUpdateReport, worker part)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightUpdateReport:
    path: str  # "disk", "tensor" or "distributed"
    version: int  # runner.weights_version after the update
    num_tensors: int  # tensors handed over (HF names, before fusing q/k/v and gate/up)
    bytes: int  # their bytes as handed over (loaded, mapped or received), in their own dtypes
    load_seconds: float  # reading the file, mapping the shared memory or receiving the broadcast
    validate_seconds: float  # staging: fusing, casting and checking them against the model
    swap_seconds: float  # copying into the live parameters, prepacking, re-attaching the backend
    source: str = ""  # the path read ("" for in-process tensors, the group name for a broadcast)

    @property
    def total_seconds(self) -> float:
        return self.load_seconds + self.validate_seconds + self.swap_seconds
