"""`radixmesh quantize`: convert a checkpoint to a GGUF of another weight format (docs/quantization.md)."""
