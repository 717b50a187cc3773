#!/usr/bin/env python
"""Writes bench/data/copy_heavy.json: the copy-heavy chat workload of speculative decoding's
benchmark and tests. Three kinds, as in the issue: summarising with quotes (the answer quotes
the passage), code edits that repeat the input (a function with one change), and multi-turn chats
that re-send their history (the last turn asks for an earlier answer again). Deterministic:
    .venv/bin/python bench/data/make_copy_heavy.py
"""
from __future__ import annotations

import json
from pathlib import Path

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wrote the weather in a leather book. Ships passing the rocky point saw his light "
    "and turned safely toward the harbour.",
    "Bees visit thousands of flowers each day. They carry pollen from one blossom to the next, which helps "
    "plants make seeds and fruit. Without bees, many of the foods we eat, such as apples and almonds, would "
    "be much harder to grow.",
    "The old library had tall windows and creaking wooden floors. Children came every Saturday to hear "
    "stories read aloud by the librarian, who changed her voice for every character and never rushed the "
    "ending.",
    "Water boils at one hundred degrees Celsius at sea level. On a high mountain the air pressure is lower, "
    "so water boils at a lower temperature, and food takes longer to cook.",
]

CODE = [
    ("def total_price(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
     "    return total\n", "rename the function total_price to order_total"),
    ("def is_even(number):\n    if number % 2 == 0:\n        return True\n    return False\n",
     "rename the parameter number to value"),
    ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
     "        self.count += 1\n        return self.count\n", "rename the class Counter to Tally"),
    ("def greet(name):\n    message = 'Hello, ' + name + '!'\n    print(message)\n    return message\n",
     "change the greeting word Hello to Welcome"),
]

HISTORY = [
    ("Name three colours of the rainbow.", "Three colours of the rainbow are red, green and blue."),
    ("What do plants need to grow?", "Plants need sunlight, water, air and nutrients from the soil to grow."),
    ("Give me a short tip for sleeping well.", "Go to bed at the same time every night and keep your room dark "
     "and quiet."),
    ("What is the largest ocean?", "The Pacific Ocean is the largest ocean on Earth."),
]


def conversations() -> list[dict]:
    out = []
    for text in PASSAGES:
        out.append({"kind": "quote", "messages": [{"role": "user", "content":
                    f"Here is a passage:\n\n{text}\n\nRepeat the passage word for word, then summarise it in "
                    "one sentence."}]})
    for code, change in CODE:
        out.append({"kind": "code_edit", "messages": [{"role": "user", "content":
                    f"Here is some Python code:\n\n{code}\nRewrite the whole code and {change}. Output only the code."}]})
    for question, answer in HISTORY:
        out.append({"kind": "multi_turn", "messages": [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "Thanks. Please repeat your previous answer exactly."}]})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("copy_heavy.json")
    path.write_text(json.dumps(conversations(), indent=1) + "\n")
    print(f"wrote {path} ({len(conversations())} conversations)")
