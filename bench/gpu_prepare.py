"""Prepare what bench/gpu_check.py needs on the GPU machine, which reaches no package registry
and takes at most 64 MiB of files: run here (with PyPI), then carry `.gpu` to the run.

    .venv/bin/python bench/gpu_prepare.py            # writes .gpu/ (git-ignored)

- .gpu/wheels: the runtime's Python packages that the GPU machine's image lacks, at this venv's
  versions (no torch, no triton: the image has CUDA builds of both). Not flashinfer-python: its
  wheel (0.7.4) is 101 MB, over the 64 MiB a device run carries; bench/gpu_wheels.sh splits it
  for two runs on a warm machine. Without it gpu_check.py reports FlashInfer as not installed.
- .gpu/smollm2: the default model's config.json and tokenizer (tokenizer.json,
  tokenizer_config.json, chat_template.jinja), from the GGUF. Its weights are not carried: the
  Q4_1 file is 94 MB, over the carry limit, so gpu_check.py times random weights of the same
  shapes, which cost the same to run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Imported by the services or the tests and absent from the GPU image (the device tool's
# KINDS.md lists what it has: grpcio, protobuf, aiohttp, prometheus-client, uvloop, pytest, ...).
MISSING_THERE = ["gguf", "xgrammar", "grpcio-health-checking", "grpcio-reflection", "opentelemetry-api",
                 "opentelemetry-sdk", "opentelemetry-proto", "opentelemetry-exporter-otlp-proto-grpc",
                 "opentelemetry-exporter-otlp-proto-common", "opentelemetry-semantic-conventions",
                 "pytest-asyncio", "openai", "distro", "jiter", "pydantic", "pydantic-core",
                 "annotated-types", "typing-inspection", "sniffio", "jsonschema", "jsonschema-specifications",
                 "referencing", "rpds-py", "aiohttp-sse-client"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]


def download(names: list[str], dest: str) -> list[str]:
    """pip-download each installed package's wheel (this venv's version) for the GPU machine's
    Python 3.12 → the names it could not get."""
    failed = []
    for name in names:
        try:
            spec = f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue  # not a dependency here either
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", dest, spec]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            failed.append(spec)
    return failed


def model_files(dest: str) -> None:
    """config.json (transformers' LlamaConfig fields) and the tokenizer of the default GGUF."""
    from services.common.model_path import default_model_path
    from services.tokenizer.gguf_tokenizer import load_gguf_tokenizer_parts
    from services.worker.loader.checkpoint import load_checkpoint
    path = default_model_path()
    mc = load_checkpoint(path).config
    os.makedirs(dest, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": mc.vocab_size,
              "hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size,
              "num_hidden_layers": mc.num_hidden_layers, "num_attention_heads": mc.num_attention_heads,
              "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
              "rms_norm_eps": mc.rms_norm_eps, "rope_theta": mc.rope_theta,
              "max_position_embeddings": mc.max_position_embeddings, "tie_word_embeddings": mc.tie_word_embeddings,
              "bos_token_id": mc.bos_token_id, "eos_token_id": list(mc.eos_token_ids), "torch_dtype": "bfloat16"}
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    parts = load_gguf_tokenizer_parts(path)
    parts.tokenizer.save(os.path.join(dest, "tokenizer.json"))
    vocab = parts.tokenizer
    tok_config = {"bos_token": vocab.id_to_token(parts.bos_token_id) if parts.bos_token_id is not None else None,
                  "eos_token": vocab.id_to_token(parts.eos_token_ids[0]) if parts.eos_token_ids else None}
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=1)
    if parts.chat_template:
        with open(os.path.join(dest, "chat_template.jinja"), "w") as f:
            f.write(parts.chat_template)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default=".gpu")
    args = p.parse_args()
    wheels = os.path.join(args.dest, "wheels")
    os.makedirs(wheels, exist_ok=True)
    failed = download(MISSING_THERE, wheels)
    model_files(os.path.join(args.dest, "smollm2"))
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(args.dest) for f in files)
    print(f"{args.dest}: {size / 2**20:.1f} MiB ({len(os.listdir(wheels))} wheels); not fetched: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
