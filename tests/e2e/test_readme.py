"""Every command and code block in README.md runs as written (issue 14).

The README's fenced blocks are extracted and run from the repository root against one real
`radixmesh up` per module: shell blocks command by command with bash (a command spans lines
through `\\` continuations and open quotes), python blocks with `.venv/bin/python -c`. The mesh
listens on a free port (--http-port 0), not on the README's 8000, which may be taken (by a
`make serve` of the person running the tests): `127.0.0.1:8000` and `localhost:8000` in a
command are replaced by the mesh's address, nothing else is changed. `make serve` and
`make test` are not run (this test runs under `make test`): exactly the lines in SKIPPED are
left out, and each must be found, so a change to the README cannot skip more than them.

Every command must exit 0; a curl to the API must print a completion (JSON with choices);
`radixmesh generate` must print its finish line; `-h` must print a usage.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.mesh_harness import REPO, Mesh

pytestmark = pytest.mark.slow

README = REPO / "README.md"
SKIPPED = {"make serve", "make test"}  # commands (comments stripped) that must not run here
README_PORT = re.compile(r"\b(?:127\.0\.0\.1|localhost):8000\b")
SHELL = {"", "sh", "bash", "shell", "console"}
# A small KV pool: the README's requests are short.
MESH_FLAGS = ["--kv-cache-bytes", str(64 << 20), "--max-requests", "8", "--max-running-requests", "8"]
COMMAND_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # where the block starts in README.md, for failure messages


def fenced_blocks(text: str) -> list[Block]:
    blocks = []
    for m in re.finditer(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", text, re.M | re.S):
        blocks.append(Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start()) + 1))
    return blocks


def shell_commands(code: str) -> list[str]:
    """The block's commands: lines joined while a `\\` continues them or a quote is open."""
    commands, buf = [], ""
    for line in code.splitlines():
        buf = f"{buf}\n{line}" if buf else line
        if not buf.strip() or buf.rstrip().endswith("\\"):
            continue
        try:
            shlex.split(buf, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        commands.append(buf)
        buf = ""
    assert not buf.strip(), f"unterminated command in a README block: {buf!r}"
    return [c for c in commands if shlex.split(c, comments=True)]  # comment-only lines dropped


def bare(command: str) -> str:
    return shlex.join(shlex.split(command, comments=True))


def collect() -> tuple[list[tuple[str, str, Block]], set[str]]:
    """(kind, code, block) for every command and python block to run; the SKIPPED lines found."""
    runs, skipped = [], set()
    for block in fenced_blocks(README.read_text(encoding="utf-8")):
        if block.lang == "python":
            runs.append(("python", block.code, block))
        elif block.lang in SHELL:
            for command in shell_commands(block.code):
                if bare(command) in SKIPPED:
                    skipped.add(bare(command))
                else:
                    runs.append(("shell", command, block))
        else:
            raise AssertionError(f"README.md:{block.line}: a ```{block.lang} block this test cannot run")
    return runs, skipped


RUNS, FOUND_SKIPPED = collect()


def test_the_skip_list_matches_the_readme_and_leaves_work():
    assert FOUND_SKIPPED == SKIPPED, f"README no longer has {SKIPPED - FOUND_SKIPPED}: update SKIPPED"
    assert any(kind == "python" for kind, _, _ in RUNS)
    assert any("curl" in code for kind, code, _ in RUNS if kind == "shell")


@pytest.fixture(scope="module")
def mesh():
    m = Mesh(*MESH_FLAGS, gateway=True)
    try:
        m.wait_ready()
        listening = next(e for e in m.log if e.get("service") == "gateway" and e.get("msg") == "listening")
        m.url = f"http://127.0.0.1:{listening['http_port']}"
        yield m
        assert m.stop() == 0
        assert m.leftover_children() == []
    finally:
        m.kill_all()


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def check_output(command: str, stdout: str) -> None:
    words = shlex.split(command, comments=True)
    if words[0] == "curl":
        body = json.loads(stdout)
        assert body.get("choices"), body
        first = body["choices"][0]
        assert (first.get("message") or {}).get("content") or first.get("text"), body
    elif "generate" in words[1:2]:
        assert re.search(r"^\[(stop|length), \d+ tokens\]$", stdout, re.M), stdout
    elif words[-1] in ("-h", "--help"):
        assert stdout.startswith("usage:"), stdout


@pytest.mark.parametrize("kind, code, block", RUNS,
                         ids=[f"L{b.line}-{kind}-{i}" for i, (kind, _, b) in enumerate(RUNS)])
def test_readme_block_runs_as_written(mesh, kind, code, block):
    if kind == "python":
        done = run([str(Path(sys.executable)), "-c", code])
    else:
        code = README_PORT.sub(mesh.url.removeprefix("http://"), code)
        done = run(["bash", "-c", code])
    where = f"README.md:{block.line}: {code}"
    assert done.returncode == 0, f"{where}\nexit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.stdout.strip(), f"{where} printed nothing"
    if kind == "shell":
        check_output(code, done.stdout)


def test_the_readme_names_the_id_the_mesh_serves(mesh):
    """The README's requests name `SmolLM2-135M-Instruct`: the id /v1/models reports for the default model."""
    done = run(["curl", "-sf", f"{mesh.url}/v1/models"])
    assert done.returncode == 0, done.stderr
    assert [m["id"] for m in json.loads(done.stdout)["data"]] == ["SmolLM2-135M-Instruct"]
    assert '"model": "SmolLM2-135M-Instruct"' in README.read_text(encoding="utf-8")
