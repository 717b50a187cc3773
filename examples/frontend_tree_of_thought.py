"""Tree of thought with radixmesh.lang against `make serve`: a fork's branches share the question's
KV (prefilled once), each proposes an idea, a select judges them.
Run: .venv/bin/python examples/frontend_tree_of_thought.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixmesh.lang import HttpBackend, assistant, function, gen, select, system, user  # noqa: E402


@function
def tree(s, question, width=3):
    s += system("You think step by step and keep each idea to one sentence.")
    s += user(question)
    ideas = s.fork(width)
    for i, f in enumerate(ideas):
        f += assistant(f"Idea {i + 1}:", gen("idea", max_tokens=24, stop="\n"))
    ideas.join()
    s += user("Ideas:\n" + "\n".join(f"{i + 1}. {x.strip()}" for i, x in enumerate(s["idea"]))
              + "\nWhich idea is best? Answer with its number.")
    s += assistant(select("best", [str(i + 1) for i in range(width)]))


if __name__ == "__main__":
    st = tree.run(question="How can I learn to cook?",
                  backend=HttpBackend(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
    for i, idea in enumerate(st["idea"]):
        print(i + 1, idea.strip())
    print("best:", st["best"])
