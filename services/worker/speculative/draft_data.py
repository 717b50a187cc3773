"""The training data of `radixmesh train-draft` (train_draft.py): the target's own answers to a
prompt set, and its teacher-forced features along them.

- Answers come from radixmesh's own Engine in float32 (services/engine/draft_answers.py: the
  engine sits above the worker, so the command's entry point lives there), whose greedy tokens
  are transformers' token for token, with every prompt of a round batched into the same decode
  steps: the generation stage is what limits how much a head can learn from.
- Beyond each prompt's greedy answer, `--samples-per-prompt` - 1 sampled ones (temperature
  `--sample-temperature`, a fixed seed): other paths through the same prompt. The labels are the
  target's own distribution at every position of whatever text it is fed, so a sampled answer
  is as valid a teacher-forced sequence as the greedy one.
- `--copy-prompts`: a second round built from the first round's answers, where the right
  continuation repeats text already in the context (quote it back, re-send the history and ask
  again, edit code and return it whole). Chat prompts alone never show a head that its context
  can be copied; served conversations do this all the time (bench/data/copy_heavy.json holds
  such requests for the bench, over other texts).
- Features: one transformers float32 forward per prompt + answer, capturing the residual
  streams the head fuses, the target's argmax and its final hidden state (the soft labels).
"""
from __future__ import annotations

import random

import torch
from tqdm import tqdm

QUOTE_ASKS = (
    "Repeat the text word for word, then summarise it in one sentence.",
    "Copy the text exactly as written, then list its two most important points.",
    "Quote the text in full, then say who it would be most useful to.",
    "Write the text out again unchanged, then give it a short title.",
)
FOLLOW_UPS = (
    "Please repeat your answer exactly, then add one more sentence at the end.",
    "Say that again word for word, and then explain the hardest part more simply.",
    "Repeat your previous answer, but put it in a numbered list if it is not one already.",
)
CODE_ASKS = (
    "Add a short comment above each function and return the whole code.",
    "Rename the main function to `run` and return the complete code.",
    "Return the same code with type hints added where they are missing.",
)


def copy_conversations(answered: list[tuple[list[dict], str]], rng: random.Random) -> list[list[dict]]:
    """For each (prompt messages, answer text), one conversation whose answer copies from its
    context: a code answer -> an edit that returns the whole code; others -> quote it back from a
    fresh user turn, or re-send the history and ask for the answer again."""
    out = []
    for messages, text in answered:
        text = text.strip()
        if len(text) < 40:
            continue
        code = _code_block(text)
        if code:
            out.append([{"role": "user", "content": f"Here is some code:\n\n{code}\n\n{rng.choice(CODE_ASKS)}"}])
        elif rng.random() < 0.5:
            out.append([{"role": "user", "content": f"Here is a text:\n\n{text}\n\n{rng.choice(QUOTE_ASKS)}"}])
        else:
            out.append(messages + [{"role": "assistant", "content": text},
                                        {"role": "user", "content": rng.choice(FOLLOW_UPS)}])
    return out


def _code_block(text: str) -> str | None:
    """The first fenced code block of an answer, fences included, or None."""
    start = text.find("```")
    end = text.find("```", start + 3) if start >= 0 else -1
    return text[start: end + 3] if end > start else None


@torch.no_grad()
def features(model, prompt_ids: list[list[int]], answers: list[list[int]], capture: tuple[int, ...],
             desc: str) -> list[dict]:
    """Teacher-forced prompt + answer -> per sequence: tokens [T], prompt_len, aux [T, k * H]
    (bf16: the residual streams entering the capture layers), next_ids [T] (the target's argmax),
    final [T, H] (bf16: the target's last hidden state after its final norm, whose product with
    the embedding gives the target's logits: the soft labels)."""
    seqs = []
    for p, a in tqdm(list(zip(prompt_ids, answers)), desc=desc, unit="seq"):
        tokens = torch.tensor([p + a])
        out = model(input_ids=tokens, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[l][0] for l in capture], -1)  # hidden_states[l]: entering layer l
        seqs.append({"tokens": tokens[0].to(torch.int32), "prompt_len": len(p), "aux": aux.to(torch.bfloat16),
                     "next_ids": out.logits[0].argmax(-1).to(torch.int32),
                     "final": out.hidden_states[-1][0].to(torch.bfloat16)})
    return seqs
