"""radixmesh.lang's interpreter against a scripted backend: what each primitive sends and appends,
fork/join, run_batch's prefix prefill, streaming, token healing, the choice methods, the learnt
chat template. No mesh, no model."""
from __future__ import annotations

import math

import pytest

from radixmesh.lang import (function, gen, greedy_token_selection, select, system, token_length_normalized,
                            unconditional_likelihood_normalized, user, assistant)
from radixmesh.lang import template
from radixmesh.lang.backend import score


class FakeBackend:
    """Generates "<n chars of the prompt>" and logs every call; select's logprobs are scripted."""

    def __init__(self, logprobs: dict[str, list[float]] | None = None) -> None:
        self.calls: list[tuple] = []
        self.logprobs = logprobs or {}

    def role_format(self):
        return template.CHATML

    def generate(self, text, g):
        self.calls.append(("gen", text, g.sampling_params()))
        return f"<{len(text)}>", {"prompt_tokens": len(text)}

    def generate_stream(self, text, g):
        self.calls.append(("stream", text))
        out = f"<{len(text)}>"
        for ch in out:
            yield ch, {}

    def prefill(self, text):
        self.calls.append(("prefill", text))
        return {"prompt_tokens": len(text)}

    def choice_logprobs(self, prompt, choices, unconditional):
        self.calls.append(("select", prompt, tuple(choices)))
        cond = [self.logprobs[c] for c in choices]
        return cond, ([[None] + [-1.0] * (len(c) - 1) for c in cond] if unconditional else None)


def test_gen_appends_the_backend_text_with_roles_and_params():
    b = FakeBackend()

    @function
    def prog(s, q):
        s += system("Be brief.")
        s += user(q)
        s += assistant(gen("a", max_tokens=7, stop=["\n"], regex="[a-z]+"))

    st = prog.run(q="hi", backend=b)
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert b.calls == [("gen", prompt, {"max_new_tokens": 7, "temperature": 0.0, "stop": ["\n"], "regex": "[a-z]+"})]
    assert st["a"] == f"<{len(prompt)}>"
    assert st.text() == prompt + st["a"] + "<|im_end|>\n"


def test_gen_with_choices_is_a_select_and_json_schema_dicts_are_sent_as_strings():
    assert gen("x", choices=["a", "b"]) == select("x", ["a", "b"])
    assert gen("x", json_schema={"type": "integer"}).sampling_params()["json_schema"] == '{"type": "integer"}'
    with pytest.raises(ValueError):
        gen("x", regex="a", json_schema="{}")


def test_select_appends_the_best_choice_by_each_method():
    b = FakeBackend({" yes": [-1.0], " no way": [-0.5, -3.0], " maybe": [-0.9, -0.2]})

    @function
    def prog(s, method):
        s += "Q?"
        s += select("c", [" yes", " no way", " maybe"], method)

    assert prog.run(method=token_length_normalized, backend=b)["c"] == " maybe"  # mean -0.55
    assert prog.run(method=greedy_token_selection, backend=b)["c"] == " no way"  # first token -0.5
    # gains over the unconditional -1.0 per token after the first: " maybe" +0.8, " no way" -2.0
    st = prog.run(method=unconditional_likelihood_normalized, backend=b)
    assert st["c"] == " maybe" and st.text() == "Q? maybe"


def test_score_heals_the_boundary_token():
    prompt = "The capital is "
    rows = {  # [logprob, id, text] from the prompt's last position on
        "The capital is Paris": [[-0.1, 7, " Paris"]],  # " " + "Paris" merged: the token is the choice's
        "The capital is London": [[-2.0, 8, " "], [-5.0, 9, "London"]],  # not merged: " " is the prompt's
    }
    cond, unc = score(prompt, ["Paris", "London"], False, lambda t: 4,
                      lambda items, start: [rows[t] for t in items])
    assert cond == [[-0.1], [-5.0]] and unc is None


def test_fork_prefills_the_parent_once_then_runs_branches_and_join_gathers():
    b = FakeBackend()

    @function
    def prog(s):
        s += "Root."
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" B{i}:" + gen("v", max_tokens=2)
        forks.join()

    st = prog.run(backend=b)
    assert b.calls[0] == ("prefill", "Root.")
    assert sorted(c[1] for c in b.calls[1:]) == ["Root. B0:", "Root. B1:", "Root. B2:"]
    assert st["v"] == ["<9>", "<9>", "<9>"] and st.text() == "Root."


def test_run_batch_prefills_the_constant_prefix_once():
    b = FakeBackend()

    @function
    def prog(s, q):
        s += system("Shared instructions.")
        s += user("Q: " + q)
        s += assistant(gen("a", max_tokens=3))

    # "Q: " + q needs the argument before user() is called: the prefix ends with the system turn
    assert prog.constant_prefix(b) == "<|im_start|>system\nShared instructions.<|im_end|>\n"
    states = prog.run_batch([{"q": "one"}, {"q": "two"}, {"q": "three"}], backend=b, num_threads=2,
                            progress_bar=True)
    assert [c[0] for c in b.calls].count("prefill") == 1 and b.calls[0][0] == "prefill"
    assert [s["a"] for s in states] == [f"<{len(s.text()) - len(s['a']) - len('<|im_end|>')- 1}>" for s in states]
    assert [s.text().count(q) for s, q in zip(states, ["one", "two", "three"])] == [1, 1, 1]


def test_stream_yields_the_text_as_it_grows():
    b = FakeBackend()

    @function
    def prog(s):
        s += "Hello"
        s += gen("g", max_tokens=3)

    st = prog.run(backend=b, stream=True)
    pieces = list(st.text_iter())
    assert "".join(pieces) == "Hello<5>" and st["g"] == "<5>"  # how many pieces depends on timing


def test_errors_surface_when_reading():
    class Broken(FakeBackend):
        def generate(self, text, g):
            raise RuntimeError("boom")

    @function
    def prog(s):
        s += gen("x")

    with pytest.raises(RuntimeError, match="boom"):
        prog.run(backend=Broken())


def test_learn_splits_a_template_into_role_prefixes_and_suffixes():
    def render(messages):
        return "".join(f"[{m['role']}]{m['content']}[/{m['role']}]\n" for m in messages)

    fmt = template.learn(render)
    assert fmt.begin("user") == "[user]" and fmt.end("assistant") == "[/assistant]\n"


def test_choice_methods_on_plain_numbers():
    assert token_length_normalized([[-1.0, -1.0], [-0.5]]) == (1, [-1.0, -0.5])
    assert greedy_token_selection([[-0.1, -9.0], [-0.2]])[0] == 0
    best, scores = unconditional_likelihood_normalized([[-1.0, -1.0], [-2.0, -0.1]],
                                                       [[None, -2.0], [None, -3.0]])
    assert best == 1 and scores == pytest.approx([1.0, 2.9])
    assert token_length_normalized([[]])[1] == [-math.inf]
