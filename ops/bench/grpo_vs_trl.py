#!/usr/bin/env python3
"""streamrl vs Hugging Face TRL's GRPOTrainer on identical work, side by side, in one run.

Workloads (docs/benchmarks.md §1): the same tiny Qwen2 (random init, the same weights on both
sides: checked by digest every run), character tokenizer, task, batch shape, sampling and
optimizer on both sides (fp32, AdamW, constant lr, grad clip 1.0, temperature 1, KL 0, clip 0.2,
group-normalised advantages, token-mean loss).

  W1  digits-max, hidden 128 / 2 layers, 8 prompts x 8, <= 4 tokens: training-loop seconds
      until a step's mean reward >= 0.9 (target: streamrl <= 0.5x TRL).
  W2  digits-reverse (2..24 digits), hidden 256 / 4 layers, 16 prompts x 8, <= 32 tokens,
      15 steps: completions/s in synchronous on-policy mode (target >= 2x TRL), also with
      max_staleness 1, and the useful FLOP rate as a fraction of the matmul ceiling (in the run's
      compute dtype, --dtype) measured in the same run (training 6*params*tokens + generation 2*params*tokens: the work
      TRL does, every sample's prompt included). streamrl computes a group's prompt once (one
      prefill per prompt; a trainer row holds a group's prompt once), so it also reports the
      executed fraction: the same count with each prompt's tokens once per group.

Each side runs as a fresh process per repetition (seeds 0..reps-1); setup is excluded on both
sides (TRL: its training loop; streamrl: from Go to the last step). With --dtype bfloat16 both
sides compute in bfloat16 over float32 weights and AdamW state (streamrl's model.dtype, TRL's
bf16 mixed precision); the default is float32 on both. The TRL side is
ops/bench/trl_grpo.py, run with the python of the venv that ops/bench/setup_trl_env.sh makes
(--trl-venv, else $STREAMRL_TRL_VENV, else /tmp/streamrl-trl-venv2; made if missing, a few
minutes). Last line: one JSON object.

    python ops/bench/grpo_vs_trl.py                 # W1 and W2, 3 repetitions
    python ops/bench/grpo_vs_trl.py --workload W1 --reps 5
    python ops/bench/grpo_vs_trl.py --workload W2 --engines builtin,vllm   # W2 with each rollout engine
    python ops/bench/grpo_vs_trl.py --workload W2 --streamrl-set model.matmul_precision=medium
    python ops/bench/grpo_vs_trl.py --workload W2 --dtype bfloat16   # both sides compute in bfloat16

streamrl runs with the run's default pipeline (`pipeline: auto`: pipelines/grpo_sync.yaml at k=0, the
train stage generating, scoring and training in one process; pipelines/grpo_rollout.yaml at k=1), and
each repetition also runs k=0 on pipelines/grpo_rollout.yaml ("rollout": generation in a process of
its own, as at k=1).
With --engines builtin,vllm, W2's streamrl side also runs with stages.generate.options.engine=vllm,
in the python of the vLLM environment (--vllm-python, default .venv-vllm/bin/python, made by
ops/vllm_env.sh); W1 stays on the built-in engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, spread
from trl_grpo import weights_sha256

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRL_RUNNER = HERE / "trl_grpo.py"
TRL_SETUP = HERE / "setup_trl_env.sh"
DEFAULT_TRL_VENV = Path(os.environ.get("STREAMRL_TRL_VENV", "/tmp/streamrl-trl-venv2"))

GROUP = 8  # completions per prompt, both workloads (TRL's --num-generations)

# The model of each workload, as streamrl's model.tiny section; TRL gets the same shapes as flags.
TINY: dict[str, dict[str, int]] = {
    "W1": {"hidden": 128, "layers": 2, "heads": 4, "intermediate": 256},
    "W2": {"hidden": 256, "layers": 4, "heads": 8, "intermediate": 512},
}


def _shape_flags(workload: str) -> list[str]:
    return [x for key, value in TINY[workload].items() for x in (f"--{key}", str(value))]


W1_TRL = ["--task", "max", "--n-digits", "3", "--prompts-per-step", "8", "--num-generations", str(GROUP),
          "--max-completion-length", "4", "--steps", "300", "--stop-reward", "0.9", "--lr", "1e-3",
          *_shape_flags("W1")]
W2_TRL = ["--task", "reverse", "--n-digits", "24", "--min-digits", "2", "--max-completion-length", "32",
          "--prompts-per-step", "16", "--num-generations", str(GROUP), "--steps", "15", "--lr", "1e-3",
          *_shape_flags("W2")]


# streamrl's modes: the rollout engine and the pipeline. builtin: the run's default, `pipeline: auto`
# (grpo_sync.yaml at k=0, grpo_rollout.yaml at k=1); "rollout": the streaming pipeline at k=0 too
PIPELINES = {"builtin": None, "vllm": "grpo_rollout.yaml", "rollout": "grpo_rollout.yaml"}


def streamrl_config(workload: str, seed: int, staleness: int, run_dir: str,
                    engine: str = "builtin") -> dict[str, Any]:
    """``engine``: a mode of :data:`PIPELINES`."""
    pipeline = PIPELINES[engine]
    common: dict[str, Any] = {
        **({} if pipeline is None else {"pipeline": str(ROOT / "pipelines" / pipeline)}),
        "seed": seed,
        "output": {"run_dir": run_dir, "name": f"{workload}-{engine}-k{staleness}-s{seed}", "tensorboard": False,
                   "plot": False, "checkpoint": False, "progress": "none"},
    }
    if engine == "vllm":
        # both cores for vLLM's OpenMP threads: the explicit range beat vLLM's auto binding here
        common["stages"] = {"generate": {"options": {"engine": engine, "vllm": {"cpu_threads_bind": "0-1"}}}}
    if workload == "W1":
        return {**common,
                "model": {"tiny": {**TINY["W1"], "seed": seed}},
                "task": {"name": "digits-max", "options": {"n_digits": 3}, "seed": seed},
                "algo": {"steps": 300, "prompts_per_step": 8, "group_size": GROUP, "max_new_tokens": 4, "lr": 1e-3,
                         "max_staleness": staleness, "stop_reward": 0.9}}
    return {**common,
            "model": {"tiny": {**TINY["W2"], "seed": seed}},
            "task": {"name": "digits-reverse", "options": {"min_digits": 2, "max_digits": 24}, "seed": seed},
            "algo": {"steps": 15, "prompts_per_step": 16, "group_size": GROUP, "max_new_tokens": 32, "lr": 1e-3,
                     "max_staleness": staleness}}


def gflops(params: int, sequence_tokens: float, prompt_tokens: float, seconds: float,
           group: int = GROUP) -> tuple[float, float]:
    """Useful and executed GFLOP/s of a run. Useful: the work TRL does, training's forward and
    backward (6 x params) and generation (2 x params) over every sample's prompt and completion
    tokens. Executed: what streamrl computes of it, a group's prompt once (one prefill per prompt,
    a trainer row holding a group's prompt once), so only this one is bounded by the ceiling."""
    executed_tokens = sequence_tokens - prompt_tokens * (1 - 1 / group)
    return ((6 + 2) * params * sequence_tokens / seconds / 1e9,
            (6 + 2) * params * executed_tokens / seconds / 1e9)


def run_streamrl(workload: str, seed: int, staleness: int, tmp: Path, engine: str = "builtin",
                 python: str = sys.executable, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """One streamrl run; ``overrides``: its command line's field overrides (``--streamrl-set``)."""
    cfg_path = tmp / f"{workload}-{engine}-k{staleness}-s{seed}.yaml"
    cfg_path.write_text(yaml.safe_dump(streamrl_config(workload, seed, staleness, str(tmp / "runs"), engine)))
    proc = subprocess.run([python, "-m", "streamrl.cli", "run", str(cfg_path), *overrides, "--print-result"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"streamrl {workload} ({engine}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    batch = 64 if workload == "W1" else 128  # samples (completions) per optimizer step
    completions = len(rows) * batch
    return {
        "wall_s": result["train_s"], "setup_s": result["setup_s"], "steps": result["steps"],
        "time_to_target_s": result["time_to_target_s"],
        "completions_per_s": completions / result["train_s"],
        "gen_tokens_per_s": sum(r["response_tokens"] for r in rows) / result["train_s"],
        "sequence_tokens": sum(r["sequence_tokens"] for r in rows),
        "prompt_tokens": sum(r["sequence_tokens"] - r["response_tokens"] for r in rows),
        "first_step_ge_0.9": next((r["step"] for r in rows if r["reward_mean"] >= 0.9), None),
    }


class TrlSideError(RuntimeError):
    """The TRL side failed, or did not train the same model as streamrl's side."""


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL venv's python, making the venv with setup_trl_env.sh the first time."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"making TRL's venv at {venv} (once, a few minutes) ...", flush=True)
        subprocess.run(["bash", str(TRL_SETUP), str(venv)], check=True, timeout=1800)
    return python


def streamrl_weights_sha256(workload: str, seed: int) -> str:
    """Digest of the initial weights streamrl's run builds for ``workload`` and ``seed``."""
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    return weights_sha256(build_model(TinyModelSpec(**TINY[workload], seed=seed), build_char_tokenizer()))


def run_trl(python: Path, workload: str, args: list[str], seed: int) -> dict[str, Any]:
    proc = subprocess.run([str(python), str(TRL_RUNNER), *args, "--seed", str(seed), "--print-every", "0"],
                          capture_output=True, text=True, timeout=900)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT_JSON")), None)
    if proc.returncode != 0 or line is None:
        raise TrlSideError(f"TRL {workload} (seed {seed}) failed, rc {proc.returncode}:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    # Same code builds both models, but in two environments: a different torch in the TRL venv could
    # initialise differently, and then the two sides would not be learning from the same start.
    theirs, ours = result["model"]["init_weights_sha256"], streamrl_weights_sha256(workload, seed)
    if theirs != ours:
        raise TrlSideError(
            f"TRL {workload} (seed {seed}) started from other weights than streamrl (sha256 {theirs[:12]} vs "
            f"{ours[:12]}); versions there: {result['versions']}. Remake the venv with {TRL_SETUP}")
    if result.get("version_mismatches"):
        print(f"warning: TRL venv versions differ from the reference figures': {result['version_mismatches']}",
              file=sys.stderr)
    return result


def interleaved(workload: str, trl_args: list[str], args: argparse.Namespace, tmp: Path,
                engines: tuple[str, ...] = ("builtin",)) -> tuple[dict[tuple[str, int], list[dict[str, Any]]],
                                                                  list[dict[str, Any]]]:
    """Repetition r runs TRL, then streamrl k=0, then k=1 (per engine), then k=0 on the streaming
    pipeline, all with seed r: load drift hits every side. ``ours`` is keyed by (mode, k), the mode an
    engine or "rollout"."""
    modes = [(e, k) for e in engines for k in (0, 1)] + [("rollout", 0)]
    ours: dict[tuple[str, int], list[dict[str, Any]]] = {mode: [] for mode in modes}
    trl: list[dict[str, Any]] = []
    python = None if args.skip_trl else ensure_trl_venv(args.trl_venv)
    for seed in range(args.reps):
        if python is not None:
            trl.append(run_trl(python, workload, [*trl_args, "--dtype", args.dtype], seed))
        for engine, k in modes:
            python_of_engine = str(args.vllm_python) if engine == "vllm" else sys.executable
            ours[(engine, k)].append(run_streamrl(workload, seed, k, tmp, engine, python_of_engine,
                                                  (f"model.dtype={args.dtype}", *args.streamrl_set)))
        print(f"{workload} repetition {seed + 1}/{args.reps} done (load average {os.getloadavg()[0]:.1f})", flush=True)
    return ours, trl


def mode_key(engine: str, k: int, prefix: str = "W2") -> str:
    """A figure's key: the default mode's (the built-in engine, `pipeline: auto`) keep their names from
    before the other modes (W2_k0_...); the others name their mode (W2_rollout_k0_...)."""
    return f"{prefix}_k{k}" if engine == "builtin" else f"{prefix}_{engine}_k{k}"


def mode_label(engine: str, k: int, workload: str) -> str:
    """A mode's rows in the printed table: "W2 streamrl k=0", "W2 streamrl rollout k=0"."""
    return f"{workload} streamrl k={k}" if engine == "builtin" else f"{workload} streamrl {engine} k={k}"


def matmul_ceiling_gflops(threads: int = 2, n: int = 1024, reps: int = 30, dtype: str = "float32") -> float:
    """The host's matmul rate in ``dtype``: the ceiling of a run that computes its linear layers in it."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def w2_params() -> int:
    from streamrl.models.build import TinyModelSpec, build_model
    from streamrl.models.tokenizer import build_char_tokenizer

    model = build_model(TinyModelSpec(**TINY["W2"]), build_char_tokenizer())
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["W1", "W2", "all"], default="all")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-trl", action="store_true", help="streamrl only (no ratio)")
    ap.add_argument("--trl-venv", type=Path, default=DEFAULT_TRL_VENV,
                    help="venv of the TRL side, made by ops/bench/setup_trl_env.sh if missing "
                         "(default: $STREAMRL_TRL_VENV or /tmp/streamrl-trl-venv2)")
    ap.add_argument("--engines", default="builtin",
                    help="W2's rollout engines, comma-separated: builtin, vllm (default: builtin)")
    ap.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                    help="python of the vLLM environment (ops/vllm_env.sh makes it)")
    ap.add_argument("--streamrl-set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a field override of every streamrl run (repeatable), e.g. model.matmul_precision=medium; "
                         "the TRL side runs as it is")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="compute dtype of both sides: streamrl's model.dtype, TRL's bf16 (mixed precision over "
                         "float32 weights and AdamW state on both); W2's ceiling is the host's matmul rate in it")
    args = ap.parse_args()
    engines = tuple(e.strip() for e in args.engines.split(","))
    if set(engines) - {"builtin", "vllm"} or "builtin" not in engines:
        ap.error(f"--engines must list builtin and optionally vllm, got {args.engines!r}")
    if "vllm" in engines and not args.vllm_python.exists():
        ap.error(f"--engines has vllm but {args.vllm_python} does not exist: run `bash ops/vllm_env.sh` first")
    figures: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    # issue 24's targets (streamrl over TRL; the FLOP fraction at k=1)
    targets = {"W1_time_to_0.9_ratio_k0": "<= 0.6", "W1_time_to_0.9_ratio_k1": "<= 0.5",
               "W1_time_to_0.9_ratio_rollout_k0": "<= 0.6",
               "W2_completions_per_s_ratio_k0": ">= 1.8", "W2_completions_per_s_ratio_k1": ">= 2.5",
               "W2_completions_per_s_ratio_rollout_k0": ">= 1.8",
               "W2_flop_fraction_of_ceiling_k1": ">= 0.6"}
    trl_side: dict[str, Any] = {}  # what ran on the TRL side, for the record
    with tempfile.TemporaryDirectory(prefix="srl-bench-") as tmpdir:
        tmp = Path(tmpdir)
        rows = []
        if args.workload in ("W1", "all"):
            ours, trl = interleaved("W1", W1_TRL, args, tmp)
            if trl:  # run_trl has checked every run's initial weights against streamrl's
                trl_side = {"runner": "ops/bench/trl_grpo.py", "versions": trl[0]["versions"],
                            "same_initial_weights": True}
            for (mode, k), runs in ours.items():
                key = mode_key(mode, k, "W1")
                ttt = spread(r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None)
                steps = spread(r["first_step_ge_0.9"] for r in runs if r["first_step_ge_0.9"])
                figures[f"{key}_time_to_0.9_s"] = ttt
                figures[f"{key}_steps_to_0.9"] = steps
                # per seed (0, 1, ...): a seed's step count is fixed on each side, so runs compare seed by seed
                figures[f"{key}_steps_to_0.9_by_seed"] = [r["first_step_ge_0.9"] for r in runs]
                figures[f"{key}_setup_s"] = spread(r["setup_s"] for r in runs)
                rows.append([f"{mode_label(mode, k, 'W1')}: s to 0.9 (steps)", f"{fmt_spread(ttt, 2)} ({fmt_spread(steps, 0)})"])
            if trl:
                t = spread(r["wall_s"] for r in trl if r["first_step_reward_ge_0.9"])
                st = spread(r["first_step_reward_ge_0.9"] for r in trl if r["first_step_reward_ge_0.9"])
                baseline["W1_time_to_0.9_s"], baseline["W1_steps_to_0.9"] = t, st
                baseline["W1_steps_to_0.9_by_seed"] = [r["first_step_reward_ge_0.9"] for r in trl]
                rows.append(["W1 TRL: s to 0.9 (steps)", f"{fmt_spread(t, 2)} ({fmt_spread(st, 0)})"])
                for mode, k in ours:
                    ratios[mode_key(mode, k, "W1_time_to_0.9_ratio")] = (
                        figures[f"{mode_key(mode, k, 'W1')}_time_to_0.9_s"]["median"] / t["median"])
        if args.workload in ("W2", "all"):
            ceiling = matmul_ceiling_gflops(dtype=args.dtype)
            params = w2_params()
            figures["matmul_ceiling_gflops"] = ceiling
            rows.append([f"{args.dtype} matmul ceiling, 2 threads (GFLOP/s)", f"{ceiling:.0f}"])
            ours, trl = interleaved("W2", W2_TRL, args, tmp, engines)
            if trl:  # run_trl has checked every run's initial weights against streamrl's
                trl_side = {"runner": "ops/bench/trl_grpo.py", "versions": trl[0]["versions"],
                            "same_initial_weights": True}
            for (engine, k), runs in ours.items():
                key, label = mode_key(engine, k), mode_label(engine, k, "W2")
                cps = spread(r["completions_per_s"] for r in runs)
                tps = spread(r["gen_tokens_per_s"] for r in runs)
                flops, executed = zip(*(gflops(params, r["sequence_tokens"], r["prompt_tokens"], r["wall_s"])
                                        for r in runs), strict=True)
                figures[f"{key}_completions_per_s"] = cps
                figures[f"{key}_gen_tokens_per_s"] = tps
                figures[f"{key}_setup_s"] = spread(r["setup_s"] for r in runs)
                figures[f"{key}_useful_gflops"] = spread(flops)
                figures[f"{key}_flop_fraction_of_ceiling"] = spread(f / ceiling for f in flops)
                figures[f"{key}_executed_flop_fraction_of_ceiling"] = spread(f / ceiling for f in executed)
                rows.append([f"{label}: completions/s", fmt_spread(cps)])
                rows.append([f"{label}: gen tokens/s", fmt_spread(tps, 0)])
                rows.append([f"{label}: setup s", fmt_spread(figures[f"{key}_setup_s"], 1)])
                rows.append([f"{label}: useful GFLOP/s (fraction of ceiling)",
                             f"{fmt_spread(spread(flops))} ({spread(flops)['median'] / ceiling:.2f})"])
                rows.append([f"{label}: executed GFLOP/s (fraction of ceiling)",
                             f"{fmt_spread(spread(executed))} ({spread(executed)['median'] / ceiling:.2f})"])
                if engine != "builtin":
                    ratios[f"W2_{engine}_over_builtin_completions_per_s_k{k}"] = (
                        cps["median"] / figures[f"W2_k{k}_completions_per_s"]["median"])
            if trl:
                cps = spread(r["completions_per_s"] for r in trl)
                baseline["W2_completions_per_s"] = cps
                baseline["W2_gen_tokens_per_s"] = spread(r["gen_tokens_per_s"] for r in trl)
                rows.append(["W2 TRL: completions/s", fmt_spread(cps)])
                rows.append(["W2 TRL: gen tokens/s", fmt_spread(baseline["W2_gen_tokens_per_s"], 0)])
                for (engine, k) in ours:
                    ratios[mode_key(engine, k, "W2_completions_per_s_ratio")] = (
                        figures[f"{mode_key(engine, k)}_completions_per_s"]["median"] / cps["median"])
            for k in (0, 1):
                ratios[f"W2_flop_fraction_of_ceiling_k{k}"] = figures.get(f"W2_k{k}_flop_fraction_of_ceiling",
                                                                          {}).get("median")
        print_table(["measure", "median [min, max]"], rows)
        for k, v in ratios.items():
            print(f"ratio {k}: {v:.3f}" if isinstance(v, float) else f"ratio {k}: {v}")
    print_json_line("grpo_vs_trl", figures, baseline, ratios, targets, reps=args.reps, dtype=args.dtype, trl=trl_side or None,
                    streamrl_set=args.streamrl_set or None)


if __name__ == "__main__":
    main()
