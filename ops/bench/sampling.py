#!/usr/bin/env python3
"""A decode step's sampling: the built-in engine's ``sample_tokens`` (one uniform draw a row, inverse
transform in two levels) against torch's ``multinomial`` on the same tempered distribution (what the
engine used before: one exponential draw per vocabulary entry), per vocabulary size.

    python ops/bench/sampling.py                     # 1 and 2 torch threads
    python ops/bench/sampling.py --threads 2 --reps 21

Shapes: W1 / W2's character vocabulary (40 entries, 128 rows), a 32k vocabulary (Llama 2, 64 rows)
and Qwen2's 151,936 (64 rows), random logits, temperature 1. Each repetition times the two methods
alternately (one call each); the table gives the median [min, max] ms a call. Both return the
sampled token's logprob under the tempered distribution.

Last line: one JSON object (figures: sample_tokens' ms; baseline: multinomial's; ratio:
sample_tokens / multinomial time per shape and thread count, target <= 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench._common import fmt_spread, print_json_line, print_table, ratio, spread  # noqa: E402

SHAPES = {"chars-40": (128, 40), "llama-32000": (64, 32000), "qwen2-151936": (64, 151936)}


def multinomial_sample(logits: Any, generator: Any) -> tuple[Any, Any]:
    """The baseline: torch.multinomial on the tempered distribution, and the token's logprob."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return tokens, logp.gather(1, tokens.unsqueeze(1)).squeeze(1)


def measure(rows: int, vocab: int, reps: int) -> dict[str, dict[str, float]]:
    import torch

    from streamrl.engines.rollout import sample_tokens

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    sides = {"sample_tokens": lambda: sample_tokens(logits, temperature=1.0, generator=g),
             "multinomial": lambda: multinomial_sample(logits, g)}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(reps + 2):  # 2 warm-ups
        for side, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            if rep >= 2:
                times[side].append((time.perf_counter() - t0) * 1e3)
    return {side: spread(v) for side, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op thread counts")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    import torch

    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, (n_rows, vocab) in SHAPES.items():
            got = measure(n_rows, vocab, args.reps)
            key = f"{name}/threads-{threads}"
            figures[key], baseline[key] = got["sample_tokens"], got["multinomial"]
            ratios[key] = ratio(got["sample_tokens"], got["multinomial"])
            rows.append([name, n_rows, threads, fmt_spread(got["sample_tokens"], 3), fmt_spread(got["multinomial"], 3),
                         f"{ratios[key]:.2f}"])
    print(f"{args.reps} repetitions alternating, load {os.getloadavg()[0]:.2f}")
    print_table(["vocabulary", "rows", "threads", "sample_tokens ms", "multinomial ms", "ratio"], rows)
    print_json_line("sampling", figures, baseline, ratios, {"ratio": "<= 1"}, reps=args.reps)


if __name__ == "__main__":
    main()
