"""Few-shot QA with radixmesh.lang against `make serve` (port 8000): the examples are the constant
prefix run_batch prefills once. Run: .venv/bin/python examples/frontend_few_shot_qa.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixmesh.lang import HttpBackend, function, gen  # noqa: E402

SHOTS = "Q: What is 2 + 3?\nA: 5\nQ: What colour is the sky?\nA: blue\nQ: How many legs has a cat?\nA: four\n"


@function
def qa(s, question):
    s += SHOTS
    s += "Q: " + question + "\nA:"
    s += gen("answer", max_tokens=16, stop="\n")


if __name__ == "__main__":
    backend = HttpBackend(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000")
    questions = ["What is the capital of France?", "What is 10 - 4?", "What do bees make?"]
    for q, st in zip(questions, qa.run_batch([{"question": q} for q in questions], backend=backend,
                                             progress_bar=True)):
        print(q, "->", st["answer"].strip())
