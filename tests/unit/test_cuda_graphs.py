"""Decode CUDA graphs (services/worker/cuda_graphs.py): the host-side bucketing and padding on
the CPU, and, on a GPU, replayed steps equal to eager ones."""
from __future__ import annotations

import pytest
import torch

from services.worker.cuda_graphs import bucket_for, graph_buckets, pad_decode_inputs


def test_buckets_are_powers_of_two_then_multiples_of_eight() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(1) == [1]
    assert graph_buckets(6) == [1, 2, 4, 6]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 8, 9, 63, 64)] == [1, 4, 8, 16, 64, 64]
    assert bucket_for(65, buckets) is None and bucket_for(0, buckets) is None


def test_padding_rows_write_and_read_only_the_scratch_page() -> None:
    page_size, scratch = 4, 9
    table = torch.tensor([[3, 5, 0], [7, 8, 0], [1, 2, 6]])
    inputs = pad_decode_inputs([11, 12], [5, 2], [0, 2], table, page_size, 4, scratch)
    assert inputs.token_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [5, 2, 0, 0]
    assert inputs.page_rows.tolist() == [[3, 5, 0], [1, 2, 6], [scratch] * 3, [scratch] * 3]
    # row 0: position 5 is page 5 offset 1; row 1: position 2 is page 1 offset 2; padding: scratch slot
    assert inputs.out_slots.tolist() == [5 * 4 + 1, 1 * 4 + 2, scratch * 4, scratch * 4]
    with pytest.raises(ValueError, match="does not fit a bucket of 1"):
        pad_decode_inputs([1, 2], [0, 0], [0, 1], table, page_size, 1, scratch)


@pytest.mark.parametrize("verify", [False, True])
def test_the_captured_forward_equals_an_eager_decode_step(tmp_path, verify) -> None:
    """What a graph captures, run as it is on the CPU (Triton's interpreter): the padded static
    inputs, the backend's prepare_graph_decode and the model give the eager step's logits for the
    real rows, and the padding rows write only the scratch page. verify: request "a" verifies a
    one-token draft, two rows of one page-table row (the eager step runs it as an extend item)."""
    import triton  # a declared dependency: never skipped
    from services.step.contract import StepItem, StepPlan
    from services.common.sampling_params import SamplingParams
    from services.step.contract import NewRequestSpec
    from services.worker.cuda_graphs import DecodeGraphs
    from tests.unit.tiny_models import runner as tiny_runner, save_tiny, sequences
    path, _ = save_tiny(tmp_path, "mistral_no_window")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        r = tiny_runner(path, page_size=4, backend="triton")
        seqs = sequences("two")
        r.execute(StepPlan(0, [NewRequestSpec(rid, s, [], SamplingParams(temperature=0.0), 0) for rid, s in seqs.items()]))
        pages = {"a": list(range(0, 20)), "b": list(range(20, 28))}
        prefill = [StepItem(rid, s[:-1], 0, pages[rid], True) for rid, s in seqs.items()]
        r.compute_logits(StepPlan(1, [], prefill))
        scratch = r.kv_spec.num_pages - 1  # unused by either request
        before = r.pool.k[:, scratch * 4:(scratch + 1) * 4].clone()
        graphs = DecodeGraphs(r, max_bs=4, scratch_page=scratch)
        draft = {"a": [17] if verify else [], "b": []}
        rows = [r.requests[rid].row for rid in seqs for _ in range(1 + len(draft[rid]))]
        tokens = [t for rid, s in seqs.items() for t in [s[-1], *draft[rid]]]
        positions = [len(s) - 1 + j for rid, s in seqs.items() for j in range(1 + len(draft[rid]))]
        n = len(tokens)
        static = pad_decode_inputs(tokens, positions, rows, r.page_table[:, :graphs.max_pages], 4, 4, scratch)
        captured = graphs._forward(static, torch.arange(4), 4)()  # [4, V]: n rows + padding
        assert not torch.equal(r.pool.k[:, scratch * 4:(scratch + 1) * 4], before)  # padding wrote there
        items = [StepItem(rid, [s[-1], *draft[rid]], len(s) - 1, [], verify=bool(draft[rid])) for rid, s in seqs.items()]
        eager, _ = r.compute_logits(StepPlan(2, [], items))
    assert eager.shape[0] == n
    torch.testing.assert_close(captured[:n], eager, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_replayed_decode_steps_equal_eager_ones(tmp_path) -> None:
    """A tiny random Llama on CUDA with the triton backend: every step's logits with graphs on
    equal those with --disable-cuda-graph (mixed prefill chunks run eagerly in both)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from services.worker.config import WorkerConfig
    from services.worker.loader.checkpoint import load_checkpoint
    from services.worker.model_runner import ModelRunner
    from tests.unit.tiny_models import BATCHES, logits_by_position, save_tiny, sequences
    path, _ = save_tiny(tmp_path, "mistral_no_window")
    seqs, chunks = sequences("three_chunked"), {r: c for r, (_, c) in BATCHES["three_chunked"].items()}
    runs = []
    for disable in (True, False):
        config = WorkerConfig(device="cuda", dtype="float32", attention_backend="triton", page_size=4,
                              kv_cache_bytes=4 << 20, max_requests=4, disable_cuda_graph=disable, cuda_graph_max_bs=4)
        runner = ModelRunner(config, load_checkpoint(path))
        runs.append(logits_by_position(runner, seqs, chunks, 4))
        if not disable:
            assert runner.device_stats.graph_replays > 0
    for rid in seqs:
        for (p_eager, eager), (p_graph, graph) in zip(runs[0][rid], runs[1][rid]):
            assert p_eager == p_graph
            torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)
