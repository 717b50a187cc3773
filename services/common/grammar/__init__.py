"""Structured outputs: what a constraint is (constraint.py), the grammar backends that check,
compile and match it (backend.py, xgrammar_backend.py), shared by the scheduler (checks) and the
worker (compiles, masks)."""
