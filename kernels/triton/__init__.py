"""The GPU kernels, in Triton. Each sits beside its torch reference; the tests run them on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1), so they need no GPU."""
