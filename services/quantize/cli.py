"""`radixmesh quantize --model SRC --out DST.gguf --type T`: re-encode a checkpoint's weights."""
from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field

from services.common.config import config_from_args, flags_from_dataclass
from services.common.model_path import resolve_model_path
from services.quantize.formats import TENSOR_TYPES, TYPES, check_type


@dataclass(frozen=True)
class QuantizeConfig:
    model: str | None = field(default=None, metadata={
        "help": "the source: a .gguf file (any type gguf can dequantize) or an HF Llama directory (safetensors); "
                "default: SmolLM2-135M-Instruct"})
    out: str = field(default="", metadata={"help": "the GGUF file to write"})
    type: str = field(default="Q4_K", metadata={
        "help": "the 2-D weights' format, or a llama.cpp mix: Q4_K_M / Q5_K_M (the k-quant, with the embedding "
                "and, in llama.cpp's choice of layers, attn_v and ffn_down at Q6_K)", "choices": list(TYPES)})
    embedding_type: str = field(default="Q8_0", metadata={
        "help": "the token embedding's (and a separate output head's) format: it is the LM head too when tied, "
                "and the most sensitive weight (llama.cpp keeps it at Q6_K or above; a mix sets it to Q6_K)", "choices": list(TENSOR_TYPES)})

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required: the GGUF file to write")
        check_type(self.type)
        check_type(self.embedding_type, "--embedding-type", TENSOR_TYPES)


def convert(cfg: QuantizeConfig):
    """→ ConvertReport. ValueError for a source that is not a GGUF file."""
    src = resolve_model_path(cfg.model)
    if os.path.abspath(src) == os.path.abspath(cfg.out):
        raise ValueError("--out must differ from --model (the source is read while the output is written)")
    from services.quantize.convert import convert_gguf, convert_hf
    return (convert_hf if os.path.isdir(src) else convert_gguf)(src, cfg.out, cfg.type, cfg.embedding_type)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="radixmesh quantize", description=__doc__)
    flags_from_dataclass(QuantizeConfig, p)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(QuantizeConfig, p.parse_args(argv))
    t0 = time.perf_counter()
    report = convert(cfg)
    print(f"{report.summary()} in {time.perf_counter() - t0:.1f}s")
    return 0
