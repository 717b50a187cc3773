"""train-draft's copy round (draft_data.copy_conversations): each answered prompt becomes one
conversation whose right reply repeats text already in its context."""
from __future__ import annotations

import random

from services.worker.speculative.draft_data import CODE_ASKS, FOLLOW_UPS, QUOTE_ASKS, copy_conversations

CODE = "Here you go:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt adds two numbers."
PROSE = "Coffee was first brewed in Yemen, travelled to Europe by ship and is now grown in fifty countries."


def test_a_code_answer_becomes_an_edit_that_returns_the_code_block():
    [conv] = copy_conversations([([{"role": "user", "content": "Write add in Python."}], CODE)], random.Random(0))
    assert len(conv) == 1 and conv[0]["role"] == "user"
    content = conv[0]["content"]
    assert "```python\ndef add(a, b):\n    return a + b\n```" in content and "It adds two numbers" not in content
    assert any(content.endswith(ask) for ask in CODE_ASKS)


def test_prose_is_quoted_back_or_the_history_is_resent_with_a_follow_up():
    question = [{"role": "user", "content": "Tell me about coffee."}]
    convs = copy_conversations([(question, PROSE)] * 40, random.Random(1))
    quotes = [c for c in convs if len(c) == 1]
    follow_ups = [c for c in convs if len(c) == 3]
    assert len(quotes) + len(follow_ups) == 40 and quotes and follow_ups  # both kinds, from one seed
    for c in quotes:
        assert PROSE in c[0]["content"] and any(c[0]["content"].endswith(ask) for ask in QUOTE_ASKS)
    for c in follow_ups:
        assert c[0] == question[0] and c[1] == {"role": "assistant", "content": PROSE}
        assert c[2]["role"] == "user" and c[2]["content"] in FOLLOW_UPS


def test_short_answers_are_skipped_and_the_round_is_seeded():
    answered = [([{"role": "user", "content": "Hi"}], "Hello!"), ([{"role": "user", "content": "q"}], PROSE)]
    assert len(copy_conversations(answered, random.Random(3))) == 1
    assert copy_conversations(answered * 5, random.Random(7)) == copy_conversations(answered * 5, random.Random(7))
