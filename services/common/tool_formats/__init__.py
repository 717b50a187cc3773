"""Tool-call formats: how a model writes function calls (base.py), one file per format, and the
registry (registry.py). The gateway constrains and parses calls with them; the tokenizer detects
a template's format and writes tools into templates that do not render them."""
