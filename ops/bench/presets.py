#!/usr/bin/env python3
"""Every algorithm preset on the same digits tasks, side by side in one run: steps and seconds to a
reward target, with the grpo preset as the baseline.

Tasks (configs/grpo_digits.yaml's model, batch shape and optimizer; only the task differs):
  max      digits-max, 3 digits, <= 4 tokens (the Quickstart's task), target reward 0.9
  reverse  digits-reverse, 2 digits, <= 3 tokens (partial credit per digit), target reward 0.5

For each task, preset and repetition (seed r: the model's init, the prompts and the sampling all
change with it) one run with ``preset=<name>``, ``algo.stop_reward=<the task's target>``, at most --max-steps
steps, in this order: rep 0 of every preset, then rep 1, ... (so a load change hits all alike).
Figures: steps to the target (a run that misses it counts as --max-steps, and is counted in
``missed``), training seconds (Go to the last step) and the mean reward of the last 5 steps.
Ratio: a preset's median seconds over grpo's. Last line: one JSON object.

    python ops/bench/presets.py                          # both tasks, every preset, 3 repetitions
    python ops/bench/presets.py --tasks max --reps 5 --presets grpo,gspo
    python ops/bench/presets.py --config configs/grpo_digits_colocated.yaml --tasks max --reps 1

A preset that needs stages of its own runs on its pipeline for the config's placement instead of
the config's pipeline (PIPELINES: dapo on pipelines/dapo.yaml or dapo_colocated.yaml, ppo on
pipelines/ppo.yaml or ppo_colocated.yaml).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, spread

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_digits.yaml"
# the task section, algo.max_new_tokens, the reward target (reverse: grpo's tiny model is near 0.5
# after 300 steps, so 0.9 would only measure the step cap)
TASKS: dict[str, tuple[dict[str, Any], int, float]] = {
    "max": ({"name": "digits-max", "options": {"n_digits": 3}}, 4, 0.9),
    "reverse": ({"name": "digits-reverse", "options": {"min_digits": 2, "max_digits": 2}}, 3, 0.5),
}
# presets whose algorithm needs more stages than the config's pipeline has (dapo: the filter; ppo: the
# critic's), per placement
PIPELINES: dict[str, dict[str, Path]] = {
    "dapo": {"separate": ROOT / "pipelines" / "dapo.yaml", "colocated": ROOT / "pipelines" / "dapo_colocated.yaml"},
    "ppo": {"separate": ROOT / "pipelines" / "ppo.yaml", "colocated": ROOT / "pipelines" / "ppo_colocated.yaml"},
}


def placement_of(config: dict[str, Any], config_path: Path) -> str:
    """The placement of the config's pipeline file (separate when it says none, and for ``auto``: both
    files it picks from are)."""
    import yaml

    if config.get("pipeline", "auto") == "auto":
        return "separate"
    pipeline = (config_path.resolve().parent / config["pipeline"]).resolve()
    return str(yaml.safe_load(pipeline.read_text()).get("placement", "separate"))


def run_args(config_path: Path, task: str, preset: str, seed: int, max_steps: int,
             run_dir: str | Path) -> tuple[dict[str, Any], list[str]]:
    """``streamrl.run``'s arguments for one run of ``preset`` on ``task`` in the config's placement:
    the config with the task's section (seeded), and the overrides (the preset, the seed, the task's
    token cap and target, the step cap, ``run_dir``, no progress line, tensorboard, plot or
    checkpoint; a preset of PIPELINES on its pipeline for the placement). Also used by
    tests/e2e/test_presets_learn.py."""
    import yaml

    config = yaml.safe_load(config_path.read_text())
    section, max_new_tokens, target = TASKS[task]
    config.update(task={**section, "seed": seed}, config_dir=str(config_path.resolve().parent))
    overrides = [f"preset={preset}", f"seed={seed}", f"model.tiny.seed={seed}", f"algo.max_new_tokens={max_new_tokens}",
                 f"algo.steps={max_steps}", f"algo.stop_reward={target}", f"output.run_dir={run_dir}",
                 "output.progress=none", "output.tensorboard=false", "output.plot=false",
                 "output.checkpoint=false"]
    if preset in PIPELINES:
        placement = placement_of(config, config_path)
        if placement not in PIPELINES[preset]:
            raise SystemExit(f"preset {preset} has no pipeline for the {placement} placement here")
        overrides.append(f"pipeline={PIPELINES[preset][placement]}")
    return config, overrides


def one_run(config_path: Path, task: str, preset: str, seed: int, max_steps: int) -> dict[str, Any]:
    import streamrl

    target = TASKS[task][2]
    with tempfile.TemporaryDirectory() as tmp:
        result = streamrl.run(*run_args(config_path, task, preset, seed, max_steps, tmp))
    rewards = [m["reward_mean"] for m in result.metrics]
    reached = bool(rewards) and rewards[-1] >= target
    return {"steps": result.steps if reached else max_steps, "reached": reached,
            "seconds": result.metrics[-1]["elapsed_s"], "last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1)}


def main() -> None:
    from streamrl.config import preset_names

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="max,reverse", help="comma-separated, of: " + ", ".join(TASKS))
    parser.add_argument("--presets", default=",".join(preset_names()), help="comma-separated preset names")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--config", type=Path, default=CONFIG,
                        help="the run config (its placement); it should start from preset: grpo and set no loss")
    args = parser.parse_args()
    tasks, presets = args.tasks.split(","), args.presets.split(",")
    if "grpo" not in presets:
        presets.insert(0, "grpo")  # the baseline
    print(f"{args.config}; load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for task in tasks:
            for preset in presets:
                r = one_run(args.config, task, preset, rep, args.max_steps)
                runs.setdefault((task, preset), []).append(r)
                print(f"rep {rep} {task} {preset}: {r['steps']} steps, {r['seconds']:.1f} s, last5 "
                      f"{r['last5']:.3f}{'' if r['reached'] else ' (target missed)'}", flush=True)
    figures: dict[str, Any] = {}
    ratio: dict[str, float] = {}
    rows = []
    for (task, preset), rs in runs.items():
        steps, secs = spread(r["steps"] for r in rs), spread(r["seconds"] for r in rs)
        last5 = spread(r["last5"] for r in rs)
        missed = sum(not r["reached"] for r in rs)
        figures[f"{task}/{preset}"] = {"steps": steps, "seconds": secs, "last5": last5, "missed": missed}
        base = spread(r["seconds"] for r in runs[(task, "grpo")])
        ratio[f"{task}/{preset}"] = secs["median"] / base["median"] if base["median"] else float("nan")
        rows.append([task, preset, fmt_spread(steps, 0), fmt_spread(secs), fmt_spread(last5, 3), missed,
                     f"{ratio[f'{task}/{preset}']:.2f}"])
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print_table(["task", "preset", "steps to target", "seconds", "last-5 reward", "missed", "s / grpo"], rows)
    baseline = {k: v for k, v in figures.items() if k.endswith("/grpo")}
    print_json_line("presets", figures, baseline, ratio,
                    {"every preset reaches": {t: TASKS[t][2] for t in tasks}, "within steps": args.max_steps})


if __name__ == "__main__":
    main()
