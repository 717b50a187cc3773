"""Helpers the benchmarks and the tests share: neither production code (services/, kernels/) nor
tests (a benchmark never imports from tests/).

  random_adapter.py    random PEFT LoRA adapters on disk
  quant_blocks.py      random valid GGUF quantized blocks and QuantWeights per format
  structured_cases.py  the structured-output cases (JSON schemas, regexes, choices, EBNF grammars)
"""
