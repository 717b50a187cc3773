"""JSON extraction with a regex-constrained gen (radixmesh.lang against `make serve`).
Run: .venv/bin/python examples/frontend_json_regex.py"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from radixmesh.lang import HttpBackend, assistant, function, gen, user  # noqa: E402

PERSON = r'\{"name": "[A-Za-z ]{1,30}", "age": [0-9]{1,3}, "city": "[A-Za-z ]{1,30}"\}'


@function
def extract(s, text):
    s += user("Extract the person as JSON with name, age and city:\n" + text)
    s += assistant(gen("json", max_tokens=64, regex=PERSON))


if __name__ == "__main__":
    st = extract.run(text="Maria Lopez, 34, moved to Lisbon last spring.",
                     backend=HttpBackend(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"))
    print(json.loads(st["json"]))
