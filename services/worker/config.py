"""The worker's configuration: model, dtype, KV pool, attention backend."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import cpu_isa

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype values other than auto: KV pages stored 1 byte per element (services/worker/kv_pool.py)
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# --speculative-algorithm values: the drafter registry (services/worker/speculative/drafter.py)
# has a factory for each, and only those (tests/unit/test_ngram_drafter.py)
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")
# draft heads over the target's hidden states (speculative/eagle.py); NEXTN: the checkpoint's own MTP layer
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN")


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = field(default=None, metadata={"help": "a .gguf file or HF directory; default: SmolLM2-135M-Instruct"})
    dtype: str = field(default="auto", metadata={"help": "weights and KV dtype: auto | float32 | bfloat16 | float16 "
                                                 "(auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, else float32)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    page_size: int = field(default=16, metadata={
        "help": "tokens per KV page (16: a request's KV rows stay contiguous in runs of 16, which the CPU decode "
                "kernel reads ~20% faster than rows scattered one token at a time; prefix matches round down to pages)"})
    kv_cache_bytes: int | None = field(default=None, metadata={
        "help": "KV pool byte budget. Default: 3 GiB (~140k tokens of SmolLM2 in bfloat16), or half the memory "
                "available at start where that is less. On the host the pool's pages take memory only once "
                "written, so a pool larger than the load needs costs nothing until used"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "KV pages' storage dtype: auto (the model's dtype) | fp8_e4m3 | fp8_e5m2 (1 byte per element, "
                "per-layer scale 1.0, widened inside the attention kernels: the same --kv-cache-bytes holds about "
                "twice the tokens of bfloat16; docs/quantization.md, FP8 KV cache)"})
    kv_mem_fraction: float | None = field(default=None, metadata={"help": "size the KV pool as this fraction of free memory instead of a byte budget"})
    attention_backend: str = field(default="auto", metadata={
        "help": "auto: cpu on --device cpu; on cuda triton, or flashinfer when it is installed and "
                "--disable-cuda-graph is given (its wrappers plan on the host every step, which a replay cannot). "
                "cpu: torch + a C++ paged decode kernel (built on first use), and the CPU tuning: allocator, "
                "quantized weights, one-call decode steps, lead CPU (services/worker/attention/cpu_backend.py); "
                "triton: the Triton paged kernels (kernels/triton; CPU tensors only under TRITON_INTERPRET=1); "
                "flashinfer: FlashInfer's paged wrappers, CUDA only (falls back to triton when not installed); "
                "torch: the plain reference"})
    disable_cuda_graph: bool = field(default=False, metadata={
        "help": "CUDA: run every decode step eagerly instead of replaying graphs captured per batch-size bucket"})
    cuda_graph_max_bs: int = field(default=64, metadata={
        "help": "CUDA: capture decode graphs for batch sizes up to this many requests (buckets 1, 2, 4, 8, then "
                "multiples of 8); larger decode steps run eagerly"})
    max_requests: int = field(default=64, metadata={"help": "page-table rows: requests the worker holds at once (>= the scheduler's max_running_requests)"})
    context_length: int | None = field(default=None, metadata={"help": "cap the model's context length"})
    prepack_weights: bool = field(default=True, metadata={
        "help": "CPU, bfloat16/float16: run linears on oneDNN-prepacked weights (same results, faster)"})
    fused_ops: bool = field(default=True, metadata={
        "help": "CPU: run RMSNorm, RoPE and SwiGLU as fused C++ kernels (built on first use; else plain torch)"})
    quant_max_rows: int = field(default=2, metadata={
        "help": "CPU: steps of at most this many tokens run their linear layers on the GGUF file's own "
                "Q8_0/Q4_1 blocks (float32 math on the file's exact weights; at batch 1 about 1.6x faster than "
                "prepacked bfloat16 weights here; at 4 rows slower: bench/ceilings.py); 0: always the dense weights"})
    quant_activations: str = field(default="auto", metadata={
        "help": "CPU, with --quantization auto: the activations of the steps that run on the file's Q4_1/Q8_0 "
                "blocks (those of <= --quant-max-rows tokens, and verify steps). float32: exact float32 math on "
                "the file's weights; int8: each row quantized per group of 32 and multiplied with integer dot "
                "products as llama.cpp does (AVX512-VNNI or AVX2; ~0.6% error per linear, +0.9% "
                "perplexity; linears 11-19% faster with AVX512-VNNI, 1.9x on AVX2 alone: bench/int8_activations.py, "
                "docs/quantization.md); refused with --dtype float32, the exact mode. auto (default): int8 where "
                "the kernel has an int8 path, --dtype is not float32 and --quantization is auto; else float32"})
    quantization: str = field(default="auto", metadata={
        "help": "the format linear weights are held in (services/worker/model/weight_format.py). auto: dense "
                "in --dtype, plus a GGUF file's quantized blocks for steps of <= --quant-max-rows tokens; none: "
                "dense only; gguf: a GGUF file's quantized weights (and the embedding / tied LM head) held only as "
                "the file's blocks, computed on at every batch size, no dense copy; int8: every decoder-layer "
                "linear weight per-channel int8 at load, from any checkpoint, no dense copy (the embedding and LM "
                "head stay dense); fp8: the same in float8_e4m3fn with a float32 scale per output row (a Triton "
                "GEMM on CUDA, a per-call widening on CPU). gguf and int8 run on CPU only"})
    decode_stack: bool = field(default=True, metadata={
        "help": "CPU: run pure-decode steps of at most --quant-max-rows tokens as one C++ call (embedding, all "
                "layers, LM head; same logits as op by op, without ~600 Python-dispatched ops a step)"})
    step_team_spin_us: int = field(default=100, metadata={
        "help": "CPU, one-call decode steps: their parallel loops run on a team whose lead never waits for a "
                "preempted helper (kernels/cpu/step_team.h); an idle helper polls this long for the next loop, "
                "then sleeps. -1: run them on OpenMP instead"})
    step_team_helper_nice: int = field(default=0, metadata={
        "help": "CPU, one-call decode steps: the nice value (-20..19) of the step team's helpers. They set it "
                "themselves, so they do not inherit the lead's raised priority (--lead-nice) and outrank the "
                "mesh's other threads; higher: those preempt a helper sooner, and the lead computes what the "
                "helper left. Negative needs CAP_SYS_NICE, else the helpers keep what they inherit"})
    lead_cpu: int | None = field(default=None, metadata={
        "help": "CPU: run one-call decode steps' lead thread on this CPU and keep the worker's other threads "
                "(event loop, gRPC, the step team's helpers) off it, for machines with as few cores as the "
                "step has threads (services/worker/lead_cpu.py; radixmesh up --pin-lead-cpu also keeps the other "
                "services off it); default: no pinning"})
    lead_nice: int = field(default=-10, metadata={
        "help": "CPU: the nice value of the thread running a one-call decode step, during the step only "
                "(negative: the mesh's other threads rarely preempt it, and a preempted step-team helper "
                "costs about half as much as a preempted lead; needs CAP_SYS_NICE, else ignored with a "
                "warning); 0: leave it"})
    grammar_backend: str = field(default="xgrammar", metadata={
        "help": "structured outputs: the grammar backend that compiles constraints and masks tokens "
                "(services/common/grammar/backend.py)"})
    jump_forward: bool = field(default=False, metadata={
        "help": "structured outputs: run the tokens a grammar forces as one verify item instead of a model step "
                "each (same output; not for requests asking for logprobs). Off by default on CPU: a verify item "
                "runs op by op, not as a one-call decode step, and costs more time than it saves here "
                "(bench/structured.py: 44% fewer steps, 2.4x the time at batch 1)"})
    jump_forward_min_tokens: int = field(default=1, metadata={
        "help": "jump-forward only over at least this many forced tokens"})
    grammar_cache_size: int = field(default=64, metadata={
        "help": "compiled grammars kept (an LRU keyed by the constraint's canonical hash)"})
    speculative_algorithm: str | None = field(default=None, metadata={
        "help": "speculative decoding's drafter: NGRAM (prompt lookup over the request's own tokens), "
                "STANDALONE (a draft model, --speculative-draft-model-path), EAGLE or EAGLE3 (a draft head over "
                "the target's hidden states, SGLang's checkpoint format; EAGLE3 on the default model uses the "
                "head shipped for it), NEXTN (the MTP layer a checkpoint ships, DeepSeek's layout); none: off "
                "(services/worker/speculative)"})
    speculative_num_draft_tokens: int = field(default=7, metadata={
        "help": "speculation: the most tokens drafted per verify (the scheduler adapts the depth below it); 7 "
                "keeps a batch-1 verify at 8 rows, one pass of the quantized matmul over the weights. EAGLE/EAGLE3 "
                "count the verified root as SGLang does: a tree holds at most this many tokens minus one"})
    speculative_num_steps: int = field(default=4, metadata={
        "help": "EAGLE/EAGLE3/NEXTN: draft head steps per proposal (the draft's depth; the scheduler adapts below it)"})
    speculative_eagle_topk: int = field(default=1, metadata={
        "help": "EAGLE/EAGLE3/NEXTN: branches kept per draft step; 1 drafts a chain, more a tree verified in one target "
                "step under a tree attention mask (op by op: the one-call CPU step verifies chains only)"})
    speculative_draft_model_path: str | None = field(default=None, metadata={
        "help": "STANDALONE: the draft model (a .gguf or HF directory; the target's own file drafts on its "
                "quantized blocks). EAGLE/EAGLE3: the head's directory (config.json + safetensors, SGLang's "
                "format); default for EAGLE3 on the default model: the head shipped with radixmesh. NEXTN: the HF directory "
                "holding the MTP layer (default: --model's)"})
    speculative_draft_kv_cache_bytes: int = field(default=256 << 20, metadata={
        "help": "STANDALONE: the draft model's own KV pool byte budget (a request the pool has no room for "
                "gets no draft that step)"})
    speculative_ngram_min_match_window_size: int = field(default=2, metadata={
        "help": "NGRAM: the shortest suffix looked up (1 drafts more often, and is accepted less: "
                "bench/speculative.py)"})
    speculative_ngram_max_match_window_size: int = field(default=8, metadata={
        "help": "NGRAM: the longest suffix looked up (the longest that occurred before wins)"})
    verify_max_rows: int = field(default=16, metadata={
        "help": "CPU: a step with verify items (speculation, jump-forward) of at most this many tokens runs as "
                "one call on the quantized blocks (--decode-stack), whose logits do not depend on the rows "
                "beside them; larger ones run op by op"})
    num_threads: int | None = field(default=None, metadata={"help": "torch intra-op threads (default: all cores)"})
    pooling: str = field(default="last", metadata={
        "help": "embeddings (/v1/embeddings, embed requests): pool the final norm's output over the prompt's "
                "last token (last) or all its tokens (mean), then L2-normalize"})
    lora_paths: tuple[str, ...] = field(default=(), metadata={
        "help": "LoRA adapters to load at start, each NAME=PATH (a PEFT directory: adapter_config.json and "
                "adapter_model.safetensors; services/worker/lora); requests name their adapter"})
    max_loras: int = field(default=4, metadata={
        "help": "LoRA: adapters resident at once for batched application (a step uses at most this many; "
                "others wait on the host, least recently used evicted first); 0: no LoRA serving"})
    max_lora_rank: int = field(default=64, metadata={"help": "LoRA: the largest adapter rank accepted"})
    tp_size: int = field(default=1, metadata={
        "help": "tensor parallelism: split each layer over this many worker processes (ranks) joined by "
                "torch.distributed (gloo); the worker is rank 0 and starts the others (services/worker/parallel). "
                "It must divide the attention heads; each rank holds its share of the weights and KV"})
    ep_size: int = field(default=1, metadata={
        "help": "expert parallelism: split a MoE model's experts over this many ranks (each holds its share of "
                "whole experts; tokens cross by all-to-all), attention staying tensor-parallel over the same ranks: "
                "1 (off) or --tp-size (docs/parallelism.md)"})
    enable_dp_attention: bool = field(default=False, metadata={
        "help": "data-parallel attention (DeepSeek-style MoE models): each of the --dp-size ranks runs attention "
                "whole on its own requests and KV, under a scheduler of its own; the MoE layers gather every rank's "
                "tokens, run expert- (--ep-size) or tensor-parallel, and scatter them back (docs/parallelism.md)"})
    dp_size: int = field(default=1, metadata={
        "help": "--enable-dp-attention: the data-parallel attention ranks, each with its own scheduler and KV; "
                "must equal --tp-size (the group's ranks)"})
    ep_num_redundant_experts: int = field(default=0, metadata={
        "help": "expert parallelism: physical expert slots beyond the logical experts, holding replicas of the "
                "hottest ones (EPLB); experts + this must divide by --ep-size"})
    enable_eplb: bool = field(default=False, metadata={
        "help": "expert parallelism: re-place the experts (DeepSeek's EPLB) from the loads recorded since the "
                "last placement, every --eplb-rebalance-num-iterations forward passes, moving weights between ranks"})
    eplb_rebalance_num_iterations: int = field(default=1000, metadata={
        "help": "--enable-eplb: forward passes between two rebalances"})
    eplb_rebalance_layers_per_chunk: int = field(default=1, metadata={
        "help": "EPLB: MoE layers moved together (they switch to the new placement once all their expert "
                "weights arrived; a rebalance spreads over the next forward passes)"})
    eplb_rebalance_weights_per_pass: int = field(default=2, metadata={
        "help": "EPLB: expert weights that cross between ranks per forward pass (each crosses while the pass "
                "computes; a chunk's layers switch once all of theirs arrived)"})
    init_expert_location: str | None = field(default=None, metadata={
        "help": "expert parallelism: place the experts at start from a recorded load (a JSON dump from "
                "/admin/expert_distribution/dump) with EPLB, instead of expert e in slot e"})
    enable_two_batch_overlap: bool = field(default=False, metadata={
        "help": "expert parallelism: split each rank's tokens into two micro-batches and overlap one's "
                "all-to-all with the other's expert compute (async collectives; bench/moe.py says where it pays)"})
    pp_size: int = field(default=1, metadata={
        "help": "pipeline parallelism: split the layers over this many stages, each its own worker process(es) "
                "(--tp-size of them); with --tp-size the group has tp x pp ranks (docs/parallelism.md)"})
    pp_micro_batches: int | None = field(default=None, metadata={
        "help": "pipeline parallelism: split each step's batch by request into this many micro-batches, in "
                "flight through the stages at once (a step of one request runs whole; default: --pp-size)"})
    pp_micro_batch_tokens: int = field(default=64, metadata={
        "help": "pipeline parallelism: the fewest tokens a micro-batch holds (a step of fewer than K times this many "
                "runs as fewer micro-batches): every micro-batch reads the stage's weights again, which a small "
                "one does not repay on a CPU"})
    all_reduce: str = field(default="auto", metadata={
        "choices": ("auto", "shm", "gloo"),
        "help": "a one-stage worker group's all-reduce: shm (shared memory between the ranks of one host), gloo, "
                "or auto: the faster of the two, measured at start on this model's shapes"})
    nnodes: int = field(default=1, metadata={
        "help": "the machines (nodes) a worker group spans; each runs tp x pp / nnodes ranks. Node 0's worker "
                "serves the scheduler; each other node runs `radixmesh serve worker --node-rank K` with the same "
                "flags and --dist-init-addr (docs/parallelism.md)"})
    node_rank: int = field(default=0, metadata={"help": "this node's index in the group, 0 .. nnodes - 1"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "HOST:PORT of the group's torch.distributed rendezvous, reachable from every node (default, one "
                "node: a free loopback port)"})
    dist_timeout_s: float = field(default=30.0, metadata={
        "help": "a worker group's collectives fail after this long without every rank (a dead or hung rank "
                "is an error, never a hang)"})
    disaggregation_mode: str = field(default="null", metadata={
        "choices": ("null", "prefill", "decode"),
        "help": "prefill/decode disaggregation: null (co-located), prefill (send each request's KV to a decode "
                "worker after computing it) or decode (receive KV into this pool); the scheduler's must match "
                "(docs/disaggregation.md)"})
    disaggregation_transfer_backend: str = field(default="grpc", metadata={
        "choices": ("grpc", "shm", "mooncake"),
        "help": "disaggregation: how KV pages cross between the pools: grpc (any host), shm (one host: the "
                "decode pool in shared memory, written in place) or mooncake (Mooncake's transfer engine: TCP "
                "here, RDMA where the machine has it); both sides of a pair must use the same"})
    disaggregation_host: str = field(default="127.0.0.1", metadata={
        "help": "disaggregation, decode side: the address its transfer engine listens on and advertises "
                "(reachable from the prefill workers)"})
    disaggregation_timeout_s: float = field(default=30.0, metadata={
        "help": "disaggregation, prefill side: a send that has not landed in this long fails its request"})
    cpu_cores: tuple[int, ...] = field(default=(), metadata={
        "help": "the CPUs a worker group splits between its ranks, each rank a contiguous equal share "
                "(default: every CPU this process may use)"})

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"--pooling must be last or mean, got {self.pooling!r}")
        if self.max_requests < 1:
            raise ValueError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.lead_cpu is not None:
            from services.worker.lead_cpu import other_cpus
            other_cpus(self.lead_cpu)  # a CPU of this process's, and not its only one
        if not -20 <= self.lead_nice <= 0:
            raise ValueError(f"--lead-nice must be in [-20, 0], got {self.lead_nice}")
        if not -20 <= self.step_team_helper_nice <= 19:
            raise ValueError(f"--step-team-helper-nice must be in -20..19, got {self.step_team_helper_nice}")
        if self.step_team_spin_us < -1:
            raise ValueError(f"--step-team-spin-us must be >= -1, got {self.step_team_spin_us}")
        if self.jump_forward_min_tokens < 1:
            raise ValueError(f"--jump-forward-min-tokens must be >= 1, got {self.jump_forward_min_tokens}")
        if self.grammar_cache_size < 1:
            raise ValueError(f"--grammar-cache-size must be >= 1, got {self.grammar_cache_size}")
        if self.speculative_algorithm is not None:
            if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
                raise ValueError(f"--speculative-algorithm must be one of {sorted(SPECULATIVE_ALGORITHMS)}, "
                                 f"got {self.speculative_algorithm!r}")
            if self.speculative_algorithm == "STANDALONE" and not self.speculative_draft_model_path:
                raise ValueError("--speculative-algorithm STANDALONE drafts with a second model: give its "
                                 "checkpoint with --speculative-draft-model-path (a .gguf file or HF directory; "
                                 "the target's own file works)")
            self._check_eagle()
        if not 1 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(f"--speculative-num-draft-tokens must be in [1, 64], got {self.speculative_num_draft_tokens}")
        if self.speculative_draft_kv_cache_bytes < 1:
            raise ValueError(f"--speculative-draft-kv-cache-bytes must be >= 1, got {self.speculative_draft_kv_cache_bytes}")
        if self.verify_max_rows < 0:
            raise ValueError(f"--verify-max-rows must be >= 0, got {self.verify_max_rows}")
        from services.worker.model.weight_format import check_quantization
        check_device(self.device, self.attention_backend)
        check_quantization(self.quantization, self.device)
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quant_activations not in ("auto", "float32", "int8"):
            raise ValueError(f"--quant-activations must be auto, float32 or int8, got {self.quant_activations!r}")
        if self.quant_activations == "int8" and self.dtype == "float32":
            raise ValueError("--quant-activations int8 rounds activations; --dtype float32 is the exact mode: "
                             "use bfloat16 (the default) or float16 with it")
        if self.quant_activations == "int8" and self.quantization != "auto":
            raise ValueError("--quant-activations int8 applies to the file's blocks that --quantization auto "
                             f"uses for small steps, not to --quantization {self.quantization}")
        if self.quant_max_rows < 0:
            raise ValueError(f"--quant-max-rows must be >= 0, got {self.quant_max_rows}")
        if self.max_loras < 0:
            raise ValueError(f"--max-loras must be >= 0, got {self.max_loras}")
        if self.lora_paths and not self.max_loras:
            raise ValueError("--lora-paths needs --max-loras >= 1 (0 turns LoRA serving off)")
        if self.max_lora_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_lora_rank}")
        parse_lora_paths(self.lora_paths)  # raises on a malformed entry
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"--tp-size and --pp-size must be >= 1, got {self.tp_size} and {self.pp_size}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--nnodes must be >= 1 and --node-rank in [0, nnodes), got {self.nnodes} and "
                             f"{self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"--tp-size x --pp-size = {self.world_size} ranks do not split evenly over "
                             f"--nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT, the same on every node (node 0's address)")
        if self.dist_timeout_s <= 0:
            raise ValueError(f"--dist-timeout-s must be > 0, got {self.dist_timeout_s}")
        if self.pp_micro_batches is not None and self.pp_micro_batches < 1:
            raise ValueError(f"--pp-micro-batches must be >= 1 (1: a step's batch crosses the stages whole), "
                             f"got {self.pp_micro_batches}")
        if self.disaggregation_mode != "null" and self.world_size > 1:
            raise ValueError(f"--disaggregation-mode {self.disaggregation_mode} runs on one worker process: "
                             "--tp-size / --pp-size > 1 with disaggregation is not supported yet")
        if not self.disaggregation_timeout_s > 0:
            raise ValueError(f"--disaggregation-timeout-s must be > 0, got {self.disaggregation_timeout_s}")
        self._check_expert_parallel()
        self._check_dp_attention()
        if self.pp_micro_batch_tokens < 1:
            raise ValueError(f"--pp-micro-batch-tokens must be >= 1, got {self.pp_micro_batch_tokens}")

    def _check_eagle(self) -> None:
        """EAGLE/EAGLE3's own flags, and what they run beside (a head reads one process's hidden states)."""
        if self.speculative_algorithm not in EAGLE_ALGORITHMS:
            return
        if not 1 <= self.speculative_num_steps <= 16:
            raise ValueError(f"--speculative-num-steps must be in [1, 16], got {self.speculative_num_steps}")
        if not 1 <= self.speculative_eagle_topk <= 8:
            raise ValueError(f"--speculative-eagle-topk must be in [1, 8], got {self.speculative_eagle_topk}")
        if self.speculative_eagle_topk > 1 and self.speculative_num_draft_tokens < 2:
            raise ValueError("--speculative-eagle-topk > 1 drafts a tree of --speculative-num-draft-tokens - 1 "
                             f"tokens: give --speculative-num-draft-tokens >= 2, got {self.speculative_num_draft_tokens}")
        if self.world_size > 1:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} runs on one process: the head "
                             "reads the whole residual stream (--tp-size 1 --pp-size 1)")
        if self.uses_cuda_graphs:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} runs without CUDA graphs (the "
                             "head reads the target's hidden states each step): add --disable-cuda-graph")
        if self.speculative_eagle_topk > 1 and self.resolved_attention_backend not in ("cpu", "torch"):
            raise ValueError("--speculative-eagle-topk > 1 verifies a tree under a tree attention mask, which the "
                             f"cpu and torch attention backends have; {self.resolved_attention_backend!r} verifies "
                             "chains only: use --speculative-eagle-topk 1")

    def _check_expert_parallel(self) -> None:
        ep = self.ep_size
        if ep < 1:
            raise ValueError(f"--ep-size must be >= 1, got {ep}")
        if ep > 1 and ep != self.tp_size:
            raise ValueError(f"--ep-size {ep} must equal --tp-size ({self.tp_size}): the experts are split over the "
                             "ranks whose attention is tensor-parallel (1: expert parallelism off)")
        if ep > 1 and self.pp_size > 1:
            raise ValueError("--ep-size > 1 with --pp-size > 1 is not supported: expert parallelism runs on a "
                             "one-stage group")
        extras = {"--ep-num-redundant-experts": self.ep_num_redundant_experts > 0, "--enable-eplb": self.enable_eplb,
                  "--init-expert-location": self.init_expert_location is not None,
                  "--enable-two-batch-overlap": self.enable_two_batch_overlap}
        given = [flag for flag, on in extras.items() if on]
        if given and ep == 1:
            raise ValueError(f"{', '.join(given)} place experts over an expert-parallel group: give --ep-size > 1")
        if self.ep_num_redundant_experts < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {self.ep_num_redundant_experts}")
        if self.eplb_rebalance_weights_per_pass < 1:
            raise ValueError(f"--eplb-rebalance-weights-per-pass must be >= 1, got {self.eplb_rebalance_weights_per_pass}")
        if self.eplb_rebalance_layers_per_chunk < 1:
            raise ValueError(f"--eplb-rebalance-layers-per-chunk must be >= 1, got {self.eplb_rebalance_layers_per_chunk}")
        if self.eplb_rebalance_num_iterations < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be >= 1, got {self.eplb_rebalance_num_iterations}")
        if ep > 1 and self.uses_cuda_graphs:
            raise ValueError("--ep-size > 1 runs without CUDA graphs (the all-to-all sizes change every step): "
                             "add --disable-cuda-graph")

    def _check_dp_attention(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ValueError(f"--dp-size {self.dp_size} needs --enable-dp-attention (data-parallel replicas of a "
                             "whole model are separate workers: radixmesh up --replicas N)")
        if not self.enable_dp_attention:
            return
        if self.dp_size < 2 or self.dp_size != self.tp_size:
            raise ValueError(f"--enable-dp-attention needs --dp-size >= 2 equal to --tp-size (the group's ranks, each "
                             f"one attention replica), got --dp-size {self.dp_size} --tp-size {self.tp_size}")
        refused = {"--pp-size > 1": self.pp_size > 1, "--enable-eplb": self.enable_eplb,
                   "--nnodes > 1": self.nnodes > 1,
                   "--disaggregation-mode": self.disaggregation_mode != "null"}
        given = [flag for flag, on in refused.items() if on]
        if given:
            raise ValueError(f"--enable-dp-attention with {', '.join(given)} is not supported yet")

    @property
    def world_size(self) -> int:
        """The processes of this worker's group (1: the worker alone)."""
        return self.tp_size * self.pp_size

    @property
    def resolved_pp_micro_batches(self) -> int:
        """--pp-micro-batches, or --pp-size when not given."""
        return self.pp_size if self.pp_micro_batches is None else self.pp_micro_batches

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        """--lora-paths as (name, path) pairs."""
        return parse_lora_paths(self.lora_paths)

    @property
    def resolved_dtype(self) -> str:
        """The dtype name `auto` stands for on this machine."""
        if self.dtype != "auto":
            return self.dtype
        if self.device.startswith("cuda") or cpu_isa.has_fast_bf16():
            return "bfloat16"
        return "float32"

    @property
    def resolved_attention_backend(self) -> str:
        """The backend `auto` stands for on this device (services/worker/attention/backend.py)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if torch.device(self.device).type == "cpu":
            return "cpu"
        if self.uses_cuda_graphs:  # FlashInfer re-plans on the host before each step: no captured replay
            return "triton"
        import importlib.util
        return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.on_cuda and not self.disable_cuda_graph

    @property
    def on_cuda(self) -> bool:
        """--device is a CUDA device (cuda or cuda:N)."""
        return torch.device(self.device).type == "cuda"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's storage dtype: the model's under auto, else the FP8 format named."""
        return self.torch_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]


def check_device(device: str, attention_backend: str) -> None:
    """ValueError unless `device` names a torch device type the worker runs on and the backend
    computes there (the cpu backend's kernels read host memory; flashinfer runs on CUDA only)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}") from e
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    if kind == "cuda" and attention_backend == "cpu":
        raise ValueError("--attention-backend cpu runs C++ kernels on host memory; on --device cuda use "
                         "auto, triton or flashinfer")
    if kind == "cpu" and attention_backend == "flashinfer":
        raise ValueError("--attention-backend flashinfer runs on CUDA only; on --device cpu use auto, cpu, "
                         "triton (under TRITON_INTERPRET=1) or torch")


def parse_lora_paths(entries: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """NAME=PATH entries → (name, path) pairs; ValueError for a malformed entry or a repeated name."""
    pairs = []
    for entry in entries:
        name, eq, path = entry.partition("=")
        if not (eq and name and path):
            raise ValueError(f"--lora-paths entries must be NAME=PATH, got {entry!r}")
        pairs.append((name, path))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-paths names must be distinct, got {names}")
    return tuple(pairs)
