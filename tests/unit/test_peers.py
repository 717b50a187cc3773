"""bench/peers.py without building or starting any peer: arguments, the workloads, the
llama-server command line, the results table."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "peers.py"
spec = importlib.util.spec_from_file_location("peers", PATH)
peers = sys.modules["peers"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(peers)


def test_arguments_default_to_everything_and_reject_unknown_names(capsys):
    a = peers.parse_args([])
    assert a.systems.split(",") == ["radixmesh", "llama-server", "vllm", "hf"] and not a.quick
    assert (a.threads, a.flash_attn, a.hf_batch, a.build_jobs, a.skip_limits) == (2, "on,off", 16, 2, False)
    assert peers.parse_args(["--quick", "--systems", "radixmesh", "--workloads", "single"]).quick
    assert peers.parse_args(["--peers", "radixmesh,llama,vllm"]).systems == "radixmesh,llama-server,vllm"
    for bad, message in ((["--systems", "sglang"], "--systems: unknown ['sglang']"),
                         (["--workloads", "huge"], "--workloads: unknown ['huge']"),
                         (["--flash-attn", "maybe"], "--flash-attn takes on, off, auto")):
        with pytest.raises(SystemExit) as exit_:
            peers.parse_args(bad)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_full_workloads_are_the_issues():
    single, tput, shared = peers.workloads(quick=False)
    assert (single.bench.max_concurrency, single.bench.input_len, single.bench.output_len) == (1, 64, 128)
    assert (tput.concurrency, tput.bench.num_prompts, tput.bench.input_len, tput.bench.output_len) == (64, 64, 256, 128)
    b = shared.bench
    assert (b.gsp_groups, b.gsp_prompts_per_group, b.gsp_system_prompt_len, b.gsp_question_len, b.output_len,
            b.max_concurrency) == (8, 16, 1000, 32, 64, 8)
    assert all(w.bench.ignore_eos for w in (single, tput, shared))
    assert shared.longest_request == 1096 and tput.longest_request == 384
    q_single, q_tput, q_shared = peers.workloads(quick=True)
    assert q_single.bench.num_prompts <= 4 and q_tput.bench.num_prompts <= 8
    assert q_shared.bench.gsp_groups * q_shared.bench.gsp_prompts_per_group <= 8


def test_llama_server_command_line():
    cmd = peers.llama_server_command("/x/llama-server", "/m.gguf", 8081, slots=64, ctx_per_slot=448, threads=2,
                                     flash_attn="off")
    assert cmd[0] == "/x/llama-server"
    assert cmd[cmd.index("-m") + 1] == "/m.gguf" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "8081" and cmd[cmd.index("-np") + 1] == "64"
    assert cmd[cmd.index("-c") + 1] == str(64 * 448) and cmd[cmd.index("-t") + 1] == "2"
    assert cmd[cmd.index("-fa") + 1] == "off" and "-cb" in cmd and "--no-repack" not in cmd
    assert peers.llama_server_command("b", "m", 1, 1, 1, 2, "on", no_repack=True)[-1] == "--no-repack"
    assert "-mno-amx-tile" in peers.LLAMA_CMAKE_ARGS and "-DLLAMA_OPENSSL=OFF" in peers.LLAMA_CMAKE_ARGS


def test_the_faster_flash_attention_setting_is_kept():
    assert max(["on", "off"], key=lambda fa: peers.score({"on": 30.0, "off": 20.0}[fa], False)) == "off"
    assert max(["on", "off"], key=lambda fa: peers.score({"on": 300.0, "off": 200.0}[fa], True)) == "on"
    assert peers.score(None, True) == float("-inf")


def test_no_llama_venv_means_not_installed(tmp_path):
    assert peers.llama_binary(str(tmp_path / "nothing")) is None
    assert peers.llama_venv("/c") == "/c/llama-cpp/venv"


def test_results_table_has_values_and_ratios():
    lat = lambda v: {"mean": v, "median": v, "p90": v, "p99": v}  # noqa: E731
    results = {
        "radixmesh": {"single": {"itl_ms": lat(20.0), "tpot_ms": lat(20.0), "output_throughput": 50.0},
                      "throughput": {"output_throughput": 600.0, "ttft_ms": lat(900.0)},
                      "shared-prefix": {"ttft_ms": lat(300.0), "prefix_hit_rate": 0.9}},
        "llama-server": {"single": {"itl_ms": lat(10.0), "tpot_ms": lat(10.0), "output_throughput": 100.0},
                         "throughput": {"output_throughput": 100.0, "ttft_ms": lat(5000.0)},
                         "shared-prefix": {"ttft_ms": lat(3000.0), "prefix_hit_rate": None}},
        "hf": {"throughput": {"output_throughput": 120.0}},
    }
    rows = peers.table_rows(results)
    by = {(r["workload"], r["metric"]): r for r in rows}
    assert by[("single", "ITL mean (ms)")]["radixmesh/llama-server"] == pytest.approx(2.0)
    assert by[("throughput", "output tok/s")]["radixmesh/hf"] == pytest.approx(5.0)
    assert by[("shared-prefix", "TTFT mean (ms)")]["radixmesh/llama-server"] == pytest.approx(0.1)
    assert by[("single", "ITL mean (ms)")]["radixmesh/hf"] is None
    text = peers.format_table(rows)
    line = next(ln for ln in text.splitlines() if ln.startswith("throughput") and "output tok/s" in ln)
    assert line.split()[3:10] == ["600.0", "100.0", "-", "120.0", "6.00x", "-", "5.00x"]
    assert "-" in next(ln for ln in text.splitlines() if "prefix hit rate" in ln).split()
    assert peers.table_rows({}) == []


def test_machine_names_the_cpu_and_cores():
    m = peers.machine()
    assert m["cpu"] and m["cores"] >= 1
    assert m["cpuinfo"]["model_name"] and set(m["cpuinfo"]["flags"]) >= {"avx512_bf16", "avx512_fp16", "amx_tile"}


def test_vllm_command_has_bf16_and_prefix_caching():
    cmd = peers.vllm_command("/v/bin/vllm", "/m", 8000, max_num_seqs=64)
    assert cmd[:3] == ["/v/bin/vllm", "serve", "/m"] and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "64" and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--port") + 1] == "8000" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--no-enable-prefix-caching" in peers.vllm_command("v", "m", 1, 8, prefix_caching=False)
    assert not any("prefix-caching" in c for c in peers.vllm_command("v", "m", 1, 8, prefix_caching=None))
    assert peers.vllm_env()["VLLM_CPU_KVCACHE_SPACE"]


def test_missing_vllm_is_skipped_with_the_reason(tmp_path):
    args = peers.parse_args(["--peers", "vllm", "--vllm-dir", str(tmp_path)])
    results, errors, skipped = peers.run_systems(args, "/m.gguf", [], pool=None)
    assert results == {} and errors == {} and "bench/setup_vllm.sh" in skipped["vllm"]
