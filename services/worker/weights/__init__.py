"""Weight updates for RL loops: new weights into a serving worker, between two steps.

One concept per module:
- updater.py: the three paths (from disk, from tensors / shared memory, from a
  torch.distributed broadcast), each load → stage → swap, timed into a report.py report;
- staging.py: new HF-named tensors → the model's fused parameters, checked, beside the live ones;
- architecture.py: a checkpoint from disk must be the serving architecture;
- swap.py: the in-place copy, then prepacking and the backend's attach redone;
- shared_tensors.py: the worker side of shared memory (a safetensors file, mapped);
- distributed.py: the worker side of a weight-update process group;
- errors.py: WeightUpdateError, raised with the old weights serving.
The trainer's side is services/common/weight_sync.py. ModelRunner's update_weights_from_* and
init_weights_update_group methods are the entry points.
"""
from services.worker.weights.errors import WeightUpdateError
from services.worker.weights.report import WeightUpdateReport

__all__ = ["WeightUpdateError", "WeightUpdateReport"]
