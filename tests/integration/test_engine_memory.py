"""Engine.shutdown() gives the memory back (issue 32): several Engines started and shut down in
one process, as a notebook, an RL loop or this suite does, leave RSS where the first left it;
and a loaded Engine's KV pool costs memory only for the pages its requests wrote.

Run in a child process of its own, so that what the rest of the suite holds cannot move the
figures either way."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARGIN_BYTES = 256 << 20  # what a cycle may keep: allocator slack, caches filled once per process
CYCLES = 3

SCRIPT = textwrap.dedent(f"""
    import gc, json
    import psutil
    from services.common.sampling_params import SamplingParams
    from services.engine.engine import Engine

    process = psutil.Process()
    rows = []
    for cycle in range({CYCLES} + 1):
        engine = Engine()  # default flags, as a user starts one
        loaded = process.memory_info().rss
        pool_bytes = engine.runner.kv_spec.total_bytes
        out = engine.generate("The capital of France is", SamplingParams(max_new_tokens=8, temperature=0))
        assert out.token_ids, out
        engine.shutdown()
        assert engine.runner is None
        del engine
        rows.append({{"loaded": loaded, "pool": pool_bytes, "after": process.memory_info().rss}})
    print(json.dumps(rows))
""")


def test_engines_started_and_shut_down_give_their_memory_back():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    first_after = rows[0]["after"]  # imports, kernels and caches loaded once
    for cycle, row in enumerate(rows[1:], start=1):
        assert row["after"] <= first_after + MARGIN_BYTES, (
            f"cycle {cycle}: RSS after shutdown {row['after'] / 2**30:.2f} GiB, first engine left "
            f"{first_after / 2**30:.2f} GiB: more than {MARGIN_BYTES >> 20} MB kept ({rows})")
        # The pool is mapped lazily: a loaded engine holds far less than its pool's budget.
        assert row["loaded"] - row["after"] < row["pool"] / 2, rows
