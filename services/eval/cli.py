"""`radixmesh eval perplexity|agreement`: the accuracy harness (docs/quantization.md)."""
from __future__ import annotations

import argparse
import json
import logging

from services.common.config import config_from_args, flags_from_dataclass
from services.eval.config import AgreementConfig, PerplexityConfig
from services.eval.runs import run_agreement, run_perplexity

COMMANDS = {"perplexity": PerplexityConfig, "agreement": AgreementConfig}
DESCRIPTIONS = {
    "perplexity": "perplexity of a corpus through the worker's own paged prefill (every worker flag applies)",
    "agreement": "greedy agreement with a reference (float32) over the bundled prompt set",
}


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"radixmesh eval {command}", description=DESCRIPTIONS[command])
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    flags_from_dataclass(COMMANDS[command], p)
    return p


def main(argv: list[str]) -> int:
    top = argparse.ArgumentParser(prog="radixmesh eval", description=__doc__)
    top.add_argument("command", choices=sorted(COMMANDS))
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv[:1] or ["--help"])
    args = parser(argv[0]).parse_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(COMMANDS[argv[0]], args)
    if argv[0] == "perplexity":
        result = run_perplexity(cfg).as_dict()
        text = (f"perplexity {result['perplexity']:.4f} ({result['nats_per_token']:.5f} nats/token) over "
                f"{result['tokens']} tokens of {cfg.corpus}, {result['seconds']:.1f}s")
    else:
        result = run_agreement(cfg).as_dict()
        text = (f"greedy agreement with {cfg.reference_dtype}: {result['mean_fraction']:.4f} of {result['new_tokens']} "
                f"tokens before the first divergence (mean over {result['prompts']} prompts; "
                f"{result['exact']} identical)")
    print(json.dumps(result) if args.json else text)
    return 0
