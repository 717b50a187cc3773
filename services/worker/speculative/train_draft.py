"""`radixmesh train-draft`: train an EAGLE-3 head (services/worker/speculative/eagle_head.py) for a
target model on its own answers, on the CPU.

Why self-distillation: a head is only worth its acceptance rate, the chance its drafts are what
the target itself would say; the target's greedy answers to chat prompts are exactly the text it
will be asked to continue, and need no dataset download. Steps, each cached in --cache-dir:
  (a) the target answers the prompts (radixmesh's Engine, float32, chat template, all prompts
      batched): greedily, plus sampled answers and a round of copy prompts when asked
      (--samples-per-prompt, --copy-prompts; services/engine/draft_answers.py, which is also the
      command's entry point, and draft_data.py);
  (b) a teacher-forced forward of prompt + answer gives, at every position, the residual streams
      at the head's capture layers and the target's argmax next token -> data.pt;
  (c) the draft vocabulary: the most frequent target tokens of the answers (d2t / t2d);
  (d) training-time test (TTT): --ttt-steps draft steps unrolled, step s > 0 feeding the head's
      own out_hidden of step s - 1 and attending exactly as a chain drafter does at inference
      (the true-feature entries up to the chain's start, then the chain's own draft entries), so
      the head learns from the inputs it will really see; loss: cross-entropy against the
      target's next token in the draft vocabulary (tokens outside it are skipped); AdamW with a
      cosine schedule; the head and the optimizer state saved each epoch (--resume continues);
  (e) eval on the held-out prompts: the mean acceptance length (1 + accepted drafts per verify)
      of greedy chain drafting at depth --ttt-steps, simulated teacher-forced against the
      target's greedy answer through the same `EagleHead.step` path a drafter runs -> eval.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.common.config import config_from_args, flags_from_dataclass
from services.common.model_path import resolve_model_path
from services.worker.speculative.draft_data import features
from services.worker.speculative.eagle_head import EagleHead, EagleHeadConfig, HeadKV

# (a): (config, model path, tokenizer) -> {"train": (prompt ids, answers), "heldout": (...)}
AnswerPrompts = Callable[["TrainDraftConfig", str, Any], dict[str, tuple[list, list]]]
BUNDLED_PROMPTS = os.path.join(os.path.dirname(__file__), "data", "draft_prompts.json")


@dataclass(frozen=True)
class TrainDraftConfig:
    model: str | None = field(default=None, metadata={"help": "the target: a .gguf file or an HF directory; "
                                                              "default: SmolLM2-135M-Instruct"})
    output: str = field(default="", metadata={"help": "the directory the head (config.json, model.safetensors) "
                                                      "and eval.json go to"})
    cache_dir: str | None = field(default=None, metadata={"help": "where data.pt and train_state.pt go; "
                                                                  "default: --output"})
    prompts: str | None = field(default=None, metadata={"help": "a prompts JSON ({'prompts': [{'messages', "
                                                                "'split'}]}); default: the bundled set"})
    num_prompts: int = field(default=0, metadata={"help": "train on the first N training prompts (0: all)"})
    eval_prompts: int = field(default=0, metadata={"help": "evaluate on the first N held-out prompts (0: all)"})
    max_new_tokens: int = field(default=160, metadata={"help": "the length of each generated answer"})
    epochs: int = field(default=4, metadata={"help": "passes over the training data"})
    draft_vocab_size: int = field(default=2048, metadata={"help": "the head's vocabulary: the most frequent "
                                                                  "target tokens"})
    intermediate_size: int = field(default=768, metadata={"help": "the head's MLP width"})
    ttt_steps: int = field(default=3, metadata={"help": "draft steps unrolled in training, and the eval's depth"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate (cosine decay, 3% warm-up)"})
    batch_tokens: int = field(default=512, metadata={"help": "tokens per optimizer step (whole sequences packed)"})
    samples_per_prompt: int = field(default=3, metadata={"help": "answers per training prompt: the greedy one, "
                                                                 "then sampled ones (--sample-temperature)"})
    sample_temperature: float = field(default=0.8, metadata={"help": "the sampled answers' temperature"})
    copy_prompts: bool = field(default=True, metadata={"help": "a second round of training prompts built from "
                                                               "the answers, whose replies copy from their context "
                                                               "(quote, repeat, edit code; draft_data.py)"})
    gen_batch: int = field(default=64, metadata={"help": "answers generated at once (the Engine's running requests)"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads (on a busy 2-core box, 1 is faster: thread hand-offs cost more than they save)"})
    seed: int = field(default=0, metadata={"help": "shuffling and init seed"})
    init_from_target: bool = field(default=False, metadata={"help": "start lm_head and norm from the target's "
                                                                   "output embedding rows and final norm"})
    resume: bool = field(default=False, metadata={"help": "continue from --cache-dir's train_state.pt"})

    def __post_init__(self) -> None:
        if not self.output:
            raise ValueError("--output is required: the directory the head is written to")
        if self.ttt_steps < 1 or self.epochs < 0 or self.draft_vocab_size < 1:
            raise ValueError("--ttt-steps and --draft-vocab-size must be >= 1, --epochs >= 0")
        if self.samples_per_prompt < 1 or self.gen_batch < 1:
            raise ValueError("--samples-per-prompt and --gen-batch must be >= 1")
        if not self.sample_temperature > 0:
            raise ValueError(f"--sample-temperature must be > 0, got {self.sample_temperature}")

    @property
    def cache(self) -> str:
        return self.cache_dir or self.output


# --- (a) + (b): the target's answers and features ---------------------------------------------
def load_target(path: str):
    from transformers import AutoModelForCausalLM
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def read_prompts(cfg: TrainDraftConfig) -> tuple[list[list[dict]], list[list[dict]]]:
    with open(cfg.prompts or BUNDLED_PROMPTS) as f:
        prompts = json.load(f)["prompts"]
    train = [p["messages"] for p in prompts if p.get("split", "train") == "train"]
    held = [p["messages"] for p in prompts if p.get("split") == "heldout"]
    return train[: cfg.num_prompts or None], held[: cfg.eval_prompts or None]


def collect_data(cfg: TrainDraftConfig, model_path: str, answer_prompts: AnswerPrompts) -> dict:
    """data.pt when it matches these settings, else (a) + (b) and save it. The head captures the
    residual streams SGLang's default EAGLE-3 setup does: entering layers 2, L // 2 and L - 3."""
    key = {"model": os.path.abspath(model_path), "prompts": cfg.prompts or "bundled", "num_prompts": cfg.num_prompts,
           "eval_prompts": cfg.eval_prompts, "max_new_tokens": cfg.max_new_tokens,
           "samples_per_prompt": cfg.samples_per_prompt, "sample_temperature": cfg.sample_temperature,
           "copy_prompts": cfg.copy_prompts, "seed": cfg.seed}
    path = os.path.join(cfg.cache, "data.pt")
    if os.path.exists(path):
        data = torch.load(path, weights_only=False)
        if data["key"] == key:
            print(f"reusing {path}: {len(data['train'])} training and {len(data['heldout'])} held-out sequences")
            return data
    from services.tokenizer.text_tokenizer import load_tokenizer
    tok = load_tokenizer(model_path)
    pairs = answer_prompts(cfg, model_path, tok)
    model = load_target(model_path)
    mc = model.config
    L = mc.num_hidden_layers
    capture = (2, L // 2, L - 3)
    target = {"num_layers": L, "heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
              "head_dim": getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads,
              "eps": mc.rms_norm_eps, "theta": getattr(mc, "rope_theta", None) or mc.rope_parameters["rope_theta"],
              "max_pos": mc.max_position_embeddings, "capture": capture}
    data = {"key": key, "target": target, "embed": model.get_input_embeddings().weight.detach().clone(),
            "norm": model.model.norm.weight.detach().clone()}
    for name, (ids, answers) in pairs.items():
        data[name] = features(model, ids, answers, capture, f"(b) features, {name}")
    del model
    os.makedirs(cfg.cache, exist_ok=True)
    torch.save(data, path)
    return data


# --- (c): the draft vocabulary -----------------------------------------------------------------
def draft_vocab(seqs: list[dict], size: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The `size` most frequent next tokens of the answers -> (d2t [size], t2d [vocab], coverage)."""
    counts = Counter()
    for s in seqs:
        counts.update(s["next_ids"][s["prompt_len"] - 1:].tolist())
    top = [t for t, _ in counts.most_common(size)]
    top += [t for t in range(vocab) if t not in set(top)][: size - len(top)]  # pad a tiny corpus's vocab
    ids = torch.tensor(sorted(top), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    coverage = sum(counts[t] for t in top) / max(1, sum(counts.values()))
    return ids - torch.arange(size), t2d, coverage


# --- (d): training-time test -------------------------------------------------------------------
def pack(seqs: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    order = list(seqs)
    rng.shuffle(order)
    packs, cur, n = [], [], 0
    for s in order:
        if cur and n + len(s["tokens"]) > batch_tokens:
            packs.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += len(s["tokens"])
    return packs + ([cur] if cur else [])


def unroll(head: EagleHead, seqs: list[dict], steps: int, to_draft: torch.Tensor) -> list[tuple]:
    """The TTT unroll over packed sequences -> per step (logits [r, D], targets [r] with -100
    skipped, rows [r]: the chains' entry indices, the target's logits over the draft vocabulary
    [r, D] or None when the sequences carry no `final`).

    Entry p of a sequence pairs the feature at p with token p + 1; chain p's step s sits at
    position p + s, embeds token p + s + 1 and predicts next_ids[p + s + 1]. Step 0 runs every
    entry (all are keys); later steps only the chains that reach the answer and its tokens."""
    lens = torch.tensor([len(s["tokens"]) for s in seqs])  # [b]
    per = lambda values: torch.repeat_interleave(values, lens - 1)  # noqa: E731 - per sequence -> per entry
    sid = per(torch.arange(len(seqs)))  # [n]
    pos = torch.cat([torch.arange(t - 1) for t in lens.tolist()])  # [n]
    start, length = per(lens.cumsum(0) - lens), per(lens)  # each entry's sequence offset in the flat tokens, T
    answer = per(torch.tensor([s["prompt_len"] - 1 for s in seqs]))  # next_ids[q] is an answer token for q >= this
    tokens = torch.cat([s["tokens"] for s in seqs]).long()
    next_ids = torch.cat([s["next_ids"] for s in seqs]).long()
    true_mask = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None])  # [n, n]
    cache = HeadKV.empty(head.config, head.dtype)
    hidden = head.fuse(torch.cat([s["aux"][:-1] for s in seqs]).float())
    final = torch.cat([s["final"] for s in seqs]) if all("final" in s for s in seqs) else None
    vocab_rows = head.embed_tokens[head.to_target_ids(torch.arange(head.config.draft_vocab_size))]  # [D, H]
    rows = torch.arange(len(sid))
    out = []
    for s in range(steps):
        if s == 1:  # the chains a later step scores, and their own draft entries from here on
            rows = rows[(pos + steps >= answer) & (pos + 2 < length)]
            hidden = hidden[rows]
        q = pos[rows] + s + 1  # the token each chain embeds; next_ids[q] is what it must predict
        valid = (q < length[rows]) & (q >= answer[rows])
        flat = start[rows] + torch.minimum(q, length[rows] - 1)
        eye = torch.eye(len(rows), dtype=torch.bool)
        attend = torch.cat([true_mask[rows]] + [eye] * s, 1)
        logits, hidden = head.step(head.embed(tokens[flat]), hidden, pos[rows] + s, cache, attend)
        target = to_draft[next_ids[flat]]
        teacher = None if final is None else final[flat].float() @ vocab_rows.float().T
        out.append((logits, torch.where(valid & (target >= 0), target, -100), rows, teacher))
    return out


def distill_loss(logits: torch.Tensor, target: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy against the target's distribution over the draft vocabulary (soft labels
    carry far more per token than the argmax, which matters on a small corpus), or against its
    argmax without one. logits, teacher [r, D], target [r] -> scalar."""
    if not len(target):
        return logits.sum() * 0.0
    if teacher is None:
        return F.cross_entropy(logits, target)
    return -(teacher.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def train(head: EagleHead, data: dict, cfg: TrainDraftConfig, state_path: str) -> None:
    to_draft = torch.full((head.config.vocab_size,), -1, dtype=torch.int64)
    ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    to_draft[ids] = torch.arange(head.config.draft_vocab_size)
    rng = random.Random(cfg.seed)
    steps_per_epoch = len(pack(data["train"], cfg.batch_tokens, random.Random(0)))
    total = max(1, steps_per_epoch * cfg.epochs)
    warmup = max(1, total // 33)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warmup,
                                                                 0.5 * (1 + math.cos(math.pi * min(i / total, 1.0)))))
    epoch0 = 0
    if cfg.resume and os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        rng.setstate(st["rng"])
        epoch0 = st["epoch"]
        print(f"resuming after epoch {epoch0} from {state_path}")
    weights = [0.8 ** s for s in range(cfg.ttt_steps)]
    for epoch in range(epoch0, cfg.epochs):
        packs = pack(data["train"], cfg.batch_tokens, rng)
        bar = tqdm(packs, desc=f"(d) epoch {epoch + 1}/{cfg.epochs}", unit="batch")
        for seqs in bar:
            loss, accs = 0.0, []
            for w, (logits, target, _, teacher) in zip(weights, unroll(head, seqs, cfg.ttt_steps, to_draft)):
                ok = target >= 0
                loss = loss + w * distill_loss(logits[ok], target[ok], None if teacher is None else teacher[ok])
                accs.append((logits[ok].argmax(-1) == target[ok]).float().mean().item() if ok.any() else 0.0)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        accs = held_out_accuracy(head, data["heldout"], cfg, to_draft)
        print(f"epoch {epoch + 1}: held-out accuracy per draft step " + " / ".join(f"{a:.3f}" for a in accs))
        head.save(cfg.output)
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "rng": rng.getstate(), "epoch": epoch + 1}, state_path)


@torch.no_grad()
def held_out_accuracy(head: EagleHead, seqs: list[dict], cfg: TrainDraftConfig, to_draft: torch.Tensor) -> list[float]:
    """Each TTT step's top-1 accuracy on the held-out answers (a quick per-epoch check)."""
    hits, counts = [0] * cfg.ttt_steps, [0] * cfg.ttt_steps
    for batch in pack(seqs, cfg.batch_tokens, random.Random(0)):
        for s, (logits, target, _, _) in enumerate(unroll(head, batch, cfg.ttt_steps, to_draft)):
            ok = target >= 0
            hits[s] += int((logits[ok].argmax(-1) == target[ok]).sum())
            counts[s] += int(ok.sum())
    return [h / max(1, n) for h, n in zip(hits, counts)]


# --- (e): acceptance length --------------------------------------------------------------------
@torch.no_grad()
def acceptance(head: EagleHead, seqs: list[dict], depth: int) -> dict:
    """Greedy chain drafting at `depth`, each verify accepting the drafts that match the target's
    greedy answer plus its own next token; only rounds with `depth` answer tokens left count."""
    rounds, accepted = 0, [0] * (depth + 1)
    for s in tqdm(seqs, desc="(e) acceptance", unit="seq"):
        tokens, T = s["tokens"].long(), len(s["tokens"])
        feat = head.fuse(s["aux"].float())  # [T, H]
        cache = HeadKV.empty(head.config, feat.dtype)
        m = s["prompt_len"]  # tokens[:m + 1] known, the target's features for positions < m
        n_true = 0  # the cache's true-feature entries (positions < n_true), then the last round's drafts
        while m + depth <= T - 1:
            cache.keep(n_true)
            new = torch.arange(n_true, m)  # true entries the cache lacks
            n_true = m
            logits, hidden = head.step(head.embed(tokens[new + 1]), feat[new], new, cache)
            drafts, hidden = [], hidden[-1:]
            drafts.append(int(head.to_target_ids(logits[-1].argmax())))
            for j in range(1, depth):
                logits, hidden = head.step(head.embed(torch.tensor([drafts[-1]])), hidden,
                                           torch.tensor([m + j - 1]), cache)
                drafts.append(int(head.to_target_ids(logits[-1].argmax())))
            a = 0
            while a < depth and drafts[a] == int(tokens[m + 1 + a]):
                a += 1
            accepted[a] += 1
            rounds += 1
            m += a + 1
    mean = sum((a + 1) * n for a, n in enumerate(accepted)) / max(1, rounds)
    return {"acceptance_length": mean, "depth": depth, "verify_rounds": rounds, "accepted_histogram": accepted,
            "sequences": len(seqs)}


def new_head(data: dict, cfg: TrainDraftConfig) -> EagleHead:
    embed, t = data["embed"], data["target"]
    vocab, hidden = embed.shape
    config = EagleHeadConfig(eagle3=True, hidden_size=hidden, intermediate_size=cfg.intermediate_size,
                             num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
                             head_dim=t["head_dim"], rms_norm_eps=t["eps"], rope_theta=float(t["theta"]),
                             max_position_embeddings=t["max_pos"], vocab_size=vocab,
                             draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=hidden,
                             capture_layers=tuple(t["capture"]))
    torch.manual_seed(cfg.seed)
    head = EagleHead(config, embed)
    d2t, t2d, coverage = draft_vocab(data["train"], cfg.draft_vocab_size, vocab)
    print(f"(c) draft vocabulary: {cfg.draft_vocab_size} tokens cover {coverage:.1%} of the answers' tokens")
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    with torch.no_grad():
        # The residual streams are large (RMS ~100 here): scale fc so the fused feature, which is
        # also the layer's residual, starts at RMS 1 and the attention and MLP can move it.
        sample = torch.cat([s["aux"] for s in data["train"][:32]]).float()
        head.fc.weight.div_(head.fc(sample).pow(2).mean().sqrt())
        if cfg.init_from_target:  # the target's own output layer, restricted to the draft vocab
            head.lm_head.weight.copy_(embed[head.to_target_ids(torch.arange(cfg.draft_vocab_size))])
            head.norm.weight.copy_(data["norm"])
    return head


def run(cfg: TrainDraftConfig, answer_prompts: AnswerPrompts) -> dict:
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    data = collect_data(cfg, resolve_model_path(cfg.model), answer_prompts)
    head = new_head(data, cfg)
    os.makedirs(cfg.output, exist_ok=True)
    train(head, data, cfg, os.path.join(cfg.cache, "train_state.pt"))
    head.save(cfg.output)
    result = acceptance(head.eval(), data["heldout"], cfg.ttt_steps)
    result.update(train_sequences=len(data["train"]), train_tokens=sum(len(s["tokens"]) for s in data["train"]),
                  wall_s=round(time.perf_counter() - t0, 1), config=asdict(cfg))
    with open(os.path.join(cfg.output, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"acceptance length {result['acceptance_length']:.3f} at depth {cfg.ttt_steps} over "
          f"{result['verify_rounds']} verifies of {result['sequences']} held-out answers; head in {cfg.output}")
    return result


def main(argv: list[str], answer_prompts: AnswerPrompts) -> int:
    """The command, given step (a): services/engine/draft_answers.py's answer_prompts on the Engine
    (`radixmesh train-draft` enters there)."""
    p = argparse.ArgumentParser(prog="radixmesh train-draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags_from_dataclass(TrainDraftConfig, p)
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(TrainDraftConfig, args)
    except ValueError as e:
        p.error(str(e))
    run(cfg, answer_prompts)
    return 0
