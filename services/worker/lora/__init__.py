"""Multi-LoRA serving on the worker: many PEFT adapters over one base model, in one batch.

The design, one file per concept:

- adapter.py   reads a PEFT directory (adapter_config.json + adapter_model.safetensors) into
               host tensors, refusing what it cannot run exactly (AdapterError); an adapter's
               identity (name@digest) is the KV-cache namespace of its requests.
- targets.py   where each PEFT module (q_proj ... down_proj) lives in our fused linears: a row
               range of qkv_proj or gate_up_proj, or all of o_proj / down_proj.
- stacked.py   one fused linear's resident adapters, stacked by slot ([S, W, in] A's, [S, out, W]
               B's, each slot's modules concatenated along the rank so one slot is two matmuls),
               and the hook `Linear.forward` calls to add them to the base output.
- batch.py     a step's token rows grouped by slot, computed once and shared by every linear.
- manager.py   the registry (load / unload / infos), the LRU over --max-loras slots, and the
               step's activation.

The model stays a plain nn.Module: a linear carries a hook only while some adapter is loaded,
so a worker without adapters runs exactly the code it ran before. Per step the runner maps every
token to its request's slot (base tokens to none); each hooked linear then adds
`(scale·B)(A x)` for each slot's rows, after whatever path computed the base output (prepacked,
F.linear or quantized blocks). The one-call C++ decode stack has no hooks: the runner declines
it for steps with adapter requests. (Random adapters for the tests and benchmarks:
bench/common/random_adapter.py.)
"""
