"""The accuracy harness (`radixmesh eval`): perplexity over a bundled corpus through the worker's
own paged prefill, and greedy agreement with a float32 reference (docs/quantization.md)."""
