"""A tool-use loop with radixmesh.lang against `make serve`: the model picks a tool with select,
writes its argument with a regex gen, the program runs it and appends the result, until it
answers. Run: .venv/bin/python examples/frontend_tool_use.py"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixmesh.lang import HttpBackend, function, gen, select  # noqa: E402



def calculator(expr: str) -> str:
    """Arithmetic only: the regex lets nothing but digits, letters, + - * / . and spaces through, and
    eval sees no builtins."""
    try:
        return str(eval(expr, {"__builtins__": {}}, {}))
    except Exception as e:  # a malformed expression is the tool's answer, not the program's end
        return f"error: {type(e).__name__}"


TOOLS = {"calculator": calculator,
         "lookup": lambda key: {"pi": "3.14159", "e": "2.71828"}.get(key.strip(), "unknown")}


@function
def agent(s, question, max_turns=3):
    s += ("Tools: calculator (arithmetic), lookup (constants pi, e). Use a tool, then answer.\n"
          f"Question: {question}\n")
    for _ in range(max_turns):
        s += "Action:"
        s += select("action", [" calculator", " lookup", " answer"])
        if s["action"] == " answer":
            s += ":" + gen("answer", max_tokens=16, stop="\n")
            return
        s += " input:" + gen("arg", max_tokens=16, regex=r" [0-9a-z+*/. -]{1,20}")
        s += "\nResult: " + TOOLS[s["action"].strip()](s["arg"].strip()) + "\n"


if __name__ == "__main__":
    st = agent.run(question="What is 12 * 7?",
                   backend=HttpBackend(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
    print(st.text())
