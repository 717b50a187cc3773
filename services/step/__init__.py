"""The scheduler ⇄ worker step contract: the dataclasses (`contract.py`) and their one
protobuf conversion (`convert.py`). Both sides import this package; neither imports the
other (pyproject.toml's import-linter contracts, tests/unit/test_import_contracts.py)."""
