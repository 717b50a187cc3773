"""The bundled corpus and prompt set (services/eval/corpus/README.md: sources and licences)."""
from __future__ import annotations

import json
import os

CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
# name -> file under CORPUS_DIR
BUNDLED = {"kjv": "kjv.txt", "code": "heapq_py.txt"}
PROMPTS_FILE = os.path.join(CORPUS_DIR, "prompts.json")


def corpus_path(name_or_path: str) -> str:
    """A bundled corpus's name (kjv, code) or a text file's path → the file's path."""
    if name_or_path in BUNDLED:
        return os.path.join(CORPUS_DIR, BUNDLED[name_or_path])
    if os.path.isfile(name_or_path):
        return name_or_path
    raise ValueError(f"--corpus must be one of the bundled corpora {sorted(BUNDLED)} or a text file's path, "
                     f"got {name_or_path!r}")


def read_corpus(name_or_path: str) -> str:
    with open(corpus_path(name_or_path), encoding="utf-8") as f:
        return f.read()


def load_prompts(path: str = PROMPTS_FILE) -> tuple[list[str], list[str]]:
    """The agreement prompt set → (chat prompts, raw text prompts)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return list(data["chat"]), list(data["text"])
