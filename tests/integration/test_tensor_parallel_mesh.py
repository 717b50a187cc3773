"""`radixmesh up --tp-size 3`: the OpenAI API of a mesh whose worker is a group of three ranks
(processes joined by gloo), driven with the official client. Greedy text and logprobs equal the
in-process Engine's at TP 1 (float32), with and without a LoRA adapter; streaming and
structured output work; and killing one rank
mid-stream gives the client a clean error within 10 s, stops the mesh naming the rank, and
leaves no process behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import psutil
import pytest

from services.common.sampling_params import SamplingParams
from services.engine.engine import Engine
from services.worker.config import WorkerConfig
from tests.integration.mesh_harness import SMALL_MESH, Mesh

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_model) -> str:
    """A random rank-8 LoRA adapter of every linear of the default model (PEFT's format)."""
    from bench.common.random_adapter import make_random_adapter
    return make_random_adapter(hf_model, str(tmp_path_factory.mktemp("lora") / "a"), 8, 16, seed=3)


@pytest.fixture(scope="module")
def expected(checkpoint, tokenizer, adapter) -> dict:
    """The TP 1 Engine's greedy outputs: (adapter, prompt index) → RequestOutput."""
    engine = Engine(worker=WorkerConfig(dtype="float32", kv_cache_bytes=32 << 20, max_requests=4,
                                        lora_paths=(f"a={adapter}",)), checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, logprobs=True)
        return {(name, i): engine.generate(p, sp, timeout=120, adapter=name)
                for name in ("", "a") for i, p in enumerate(PROMPTS)}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def mesh(expected, adapter):
    m = Mesh(*SMALL_MESH, "--tp-size", "3", "--lora-paths", f"a={adapter}", gateway=True)
    try:
        m.wait_ready()
        listening = {e["service"]: e for e in m.log if e.get("msg") == "listening"}
        m.url = f"http://127.0.0.1:{listening['gateway']['http_port']}"
        m.ranks = [c.pid for c in psutil.Process(m.pids["worker"]).children()
                   if "services.worker.group.follower" in " ".join(c.cmdline())]
        yield m
    finally:
        m.kill_all()


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model(client) -> str:
    return next(m.id for m in client.models.list().data if m.id != "a")


def test_the_worker_runs_as_three_ranks(mesh):
    assert len(mesh.ranks) == 2  # ranks 1 and 2; rank 0 is the worker itself


@pytest.mark.parametrize("adapter_name", ["", "a"])
@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_greedy_text_and_logprobs_equal_the_tp1_engine(client, model, expected, i, adapter_name):
    """The base model, and the LoRA adapter named as the model."""
    resp = client.completions.create(model=adapter_name or model, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                                     temperature=0, logprobs=1)
    want = expected[adapter_name, i]
    assert resp.choices[0].text == want.text
    got = resp.choices[0].logprobs.token_logprobs
    assert max(abs(a - b.logprob) for a, b in zip(got, want.logprobs, strict=True)) < 1e-4


def test_a_streamed_chat_is_the_whole_chat(client, model):
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content and text


def test_structured_output_follows_its_schema(client, model):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["city", "year"], "additionalProperties": False}
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give a city and a year as JSON."}], max_tokens=40,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema,
                                                                              "strict": True}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == {"city", "year"} and isinstance(value["year"], int)


def test_killing_a_rank_mid_stream_ends_the_stream_with_an_error_and_stops_the_mesh(mesh, client, model):
    """Run last: the mesh does not survive it."""
    got_first, events, error = threading.Event(), [], []

    def stream():
        try:
            for chunk in client.completions.create(model=model, prompt="Once upon a time", max_tokens=400,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                events.append(chunk)
                got_first.set()
        except Exception as exc:  # the SSE error event, raised by the client
            error.append(exc)
        got_first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert got_first.wait(60)
    killed = time.monotonic()
    os.kill(mesh.ranks[0], signal.SIGKILL)
    reader.join(10)
    assert not reader.is_alive(), "the stream did not end within 10 s of the rank's death"
    assert error, f"the stream ended without an error after {len(events)} chunks"
    assert time.monotonic() - killed < 10
    assert mesh.proc.wait(30) != 0  # the launcher stops the mesh and fails
    lost = [json.loads(line)["msg"] for line in mesh.raw_stderr if "worker group broken" in line]
    assert lost and "worker rank 1" in lost[0], lost
    assert not [pid for pid in [*mesh.pids.values(), *mesh.ranks] if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
