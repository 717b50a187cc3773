"""Every architecture beyond Llama/Qwen2 through the real mesh: `radixmesh up --model DIR` on a saved
random tiny float32 model (tests/unit/tiny_models.py: Qwen3, Mistral with window 8, Gemma 2 with
a window-8 sliding layer, Phi-3 with window 9, Qwen3-MoE), a word-level tokenizer.json that the
tokenizer service loads from the directory, and greedy Generate over gRPC: the streamed token ids
are transformers' greedy continuation, with 20 prompt tokens + 10 new, past every window.

One mesh per architecture (module-scoped, a 4 MiB KV pool); the same prompt sent twice checks the
second run, served from the prefix cache, computes the same tokens.
"""
from __future__ import annotations

import re

import pytest

from protos.radixmesh.v1 import tokenizer_pb2
from tests.integration.mesh_harness import Mesh, collect, finish_reason, greedy
from tests.unit.tiny_models import END_TO_END, greedy_continuation, save_for_generation, sequences

PROMPT_IDS = sequences("two")["a"][:20]
N_NEW = 10
TINY_MESH = ["--dtype", "float32", "--kv-cache-bytes", str(4 << 20), "--max-requests", "4",
             "--max-running-requests", "4", "--check-invariants"]


@pytest.fixture(scope="module", params=END_TO_END)
def tiny_mesh(request, tmp_path_factory):
    path, hf = save_for_generation(tmp_path_factory.mktemp(request.param), request.param)
    mesh = Mesh("--model", path, *TINY_MESH)
    try:
        expected = greedy_continuation(hf, PROMPT_IDS, N_NEW)  # while the mesh starts
        mesh.wait_ready(timeout=300)
        yield request.param, mesh, expected
        assert mesh.stop() == 0
        assert mesh.leftover_children() == []
    finally:
        mesh.kill_all()


def test_greedy_generate_equals_transformers(tiny_mesh):
    name, mesh, expected = tiny_mesh
    prompt = " ".join(f"t{i}" for i in PROMPT_IDS)
    for attempt in ("cold", "cached"):
        events = mesh.tokenizer().Generate(tokenizer_pb2.GenerateTextRequest(text=prompt, sampling=greedy(N_NEW)),
                                           timeout=120)
        seqs = collect(events)
        assert list(seqs) == [0], (name, attempt, seqs)
        seq = seqs[0]
        assert seq["token_ids"] == expected, (name, attempt)
        assert [int(m) for m in re.findall(r"t(\d+)", seq["text"])] == expected, (name, attempt, seq["text"])
        assert finish_reason(seq["finish"]) == "length" and seq["finishes"] == 1, (name, attempt)
        prompt_tokens, completion_tokens, cached = seq["usage"]
        assert (prompt_tokens, completion_tokens) == (len(PROMPT_IDS), N_NEW), (name, attempt)
        assert (cached > 0) == (attempt == "cached"), (name, attempt, cached)
