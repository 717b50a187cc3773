"""A checkpoint → GGUF in another weight format, written with `gguf.GGUFWriter`: from a GGUF every
metadata key copied (tokenizer, chat template, architecture) and every tensor dequantized to float32
and re-encoded; from an HF Llama directory what llama.cpp's converter would write, encoded the same
way (services/quantize/formats.py picks each tensor's type)."""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

import gguf

from services.common.gguf_reader import FastGGUFReader
from services.quantize.formats import QType, encode, tensor_type

log = logging.getLogger(__name__)
# Written by GGUFWriter itself (header counts, the architecture it was given) or changed here.
_SKIPPED_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}
# general.file_type (llama.cpp's LlamaFileType) of a file mostly in that type
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K": 14, "Q4_K_M": 15,
              "Q5_K": 16, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}


@dataclass
class ConvertReport:
    out: str
    types: Counter = field(default_factory=Counter)  # tensor type -> how many tensors
    bytes: int = 0  # the output file's size

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
        return f"wrote {self.out}: {sum(self.types.values())} tensors ({kinds}), {self.bytes / 2**20:.1f} MiB"


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, f in reader.fields.items():
        if name in _SKIPPED_KEYS or not f.types:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)


def convert_gguf(src: str, out: str, target: str, embedding: str) -> ConvertReport:
    """Re-encode GGUF file `src` into `out`: 2-D weights in `target`, the embedding/output head in
    `embedding`, 1-D tensors F32 (formats.tensor_type)."""
    reader = FastGGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    _copy_metadata(reader, writer)
    tensors = ((t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)]))
               for t in reader.tensors)  # float32, numpy shape (rows last), one at a time
    n_layers = 1 + max((int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")), default=-1)
    return _write(writer, tensors, out, target, embedding, n_layers)


def convert_hf(src: str, out: str, target: str, embedding: str) -> ConvertReport:
    """An HF Llama directory → GGUF `out`, as llama.cpp's converter lays it out (hf_source.py), encoded
    as convert_gguf encodes."""
    from services.quantize.hf_source import add_metadata, hf_tensors, read_config
    raw = read_config(src)
    writer = gguf.GGUFWriter(out, "llama")
    add_metadata(writer, src, raw)
    return _write(writer, iter(hf_tensors(src, raw).items()), out, target, embedding, raw["num_hidden_layers"])


def _write(writer: gguf.GGUFWriter, tensors, out: str, target: str, embedding: str, n_layers: int) -> ConvertReport:
    writer.add_file_type(FILE_TYPES.get(target, 0))
    report = ConvertReport(out)
    for name, data in tensors:
        qtype = tensor_type(name, data.shape, target, embedding, n_layers)
        # F32/F16 arrays carry their type; anything else is bytes the writer must be told the type of.
        writer.add_tensor(name, encode(data, qtype), raw_dtype=None if qtype in ("F32", "F16") else QType[qtype])
        report.types[qtype] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    report.bytes = os.path.getsize(out)
    return report
