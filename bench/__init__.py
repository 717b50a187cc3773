"""Benchmarks: scripts run as `python bench/NAME.py` (each puts the repository root on sys.path).
A package only so that `bench.common`, the helpers the benchmarks share with the tests, imports
the same way from both; the scripts themselves are not imported as `bench.*`."""
