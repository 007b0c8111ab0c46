#!/usr/bin/env python3
"""Engine-only GRPO benchmark: streamrl's compute path in one process, no dock, vs TRL.

A synchronous loop — generate (TorchRolloutEngine) -> score (task reward) -> group advantages
-> accumulate + step (FSDPTrainEngine, a world of one) — on the baseline's workloads
(docs/benchmarks.md §1):

  W1  digits-max, hidden 128, 2 layers, 4 heads, 8 prompts x 8, <= 4 tokens, lr 1e-3, up to 300
      steps, stop at mean reward >= 0.9: steps and training-loop seconds to 0.9.
  W2  digits-reverse 2..24 digits, hidden 256, 4 layers, 8 heads, intermediate 512, 16 prompts
      x 8, <= 32 tokens, 15 steps: completions/s and generated tokens/s.

Both: fp32, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), max grad norm 1.0, temperature 1,
no top-k/top-p, token-mean loss, clip 0.2, KL 0; the old policy is the rollout policy (one
update per batch, as TRL with num_iterations=1). Same init weights as TRL (seed 0).

When TRL's venv exists ($STREAMRL_TRL_VENV, else /tmp/streamrl-trl-venv2; made by
ops/bench/setup_trl_env.sh), the same workloads run through ops/bench/trl_grpo.py in the same
session, interleaved with ours, and the ratios are
printed. The LAST line is one JSON object: name, figures, baseline, ratio, target.

  python ops/bench/engine_only.py                    # W1 + W2, 3 repeats each side
  python ops/bench/engine_only.py --workload W2 --repeats 2 --no-trl
  python ops/bench/engine_only.py --workload W1 --learn-seeds 0 1 2 3 --no-trl
  python ops/bench/engine_only.py --threads 1         # robust on a busy shared machine
  python ops/bench/engine_only.py --omp-passive       # idem, keeping 2 threads
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from streamrl.algos.grpo import LossConfig, group_advantages
from streamrl.engines.fsdp import FSDPTrainEngine
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.samples import TrainSample
from streamrl.models.build import TinyModelSpec, build_model
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.tasks import get_task

try:
    from ops.bench._common import print_json_line, spread
except ImportError:  # run as a script: ops/ is not a package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import print_json_line, spread

TRL_PYTHON = Path(os.environ.get("STREAMRL_TRL_VENV", "/tmp/streamrl-trl-venv2")) / "bin" / "python"
TRL_SCRIPT = Path(__file__).resolve().parent / "trl_grpo.py"  # the project's own TRL runner


@dataclass(frozen=True)
class Workload:
    name: str
    task: str
    task_options: dict
    spec: TinyModelSpec
    prompts_per_step: int
    generations: int
    max_new_tokens: int
    steps: int
    stop_reward: float | None
    lr: float
    trl_args: tuple[str, ...]


W1 = Workload(
    "W1", "digits-max", {"n_digits": 3}, TinyModelSpec(), 8, 8, 4, 300, 0.9, 1e-3,
    ("--task", "max", "--steps", "300", "--stop-reward", "0.9"),
)
W2 = Workload(
    "W2", "digits-reverse", {"min_digits": 2, "max_digits": 24},
    TinyModelSpec(hidden=256, layers=4, heads=8, intermediate=512), 16, 8, 32, 15, None, 1e-3,
    ("--task", "reverse", "--n-digits", "24", "--min-digits", "2", "--max-completion-length", "32",
     "--hidden", "256", "--layers", "4", "--heads", "8", "--intermediate", "512",
     "--prompts-per-step", "16", "--num-generations", "8", "--steps", "15", "--lr", "1e-3"),
)


def run_streamrl(w: Workload, seed: int = 0, micro_batch: int = 0, log_every: int = 0) -> dict:
    """One training run; wall time covers the loop only (model build excluded, as TRL's)."""
    tokenizer = build_char_tokenizer()
    task = get_task(w.task, **w.task_options)
    spec = TinyModelSpec(**{**{f: getattr(w.spec, f) for f in w.spec.__struct_fields__}, "seed": seed})
    # the rollout has its own copy (the trainer's module holds FSDP2 DTensors) and loads each new
    # version's full weights, as the separate placement's generator does
    rollout_model = build_model(spec, tokenizer)
    rollout = TorchRolloutEngine(rollout_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "cpu")
    trainer = FSDPTrainEngine(build_model(spec, tokenizer), lr=w.lr, max_grad_norm=1.0, device="cpu")
    loss_config = LossConfig()  # token-mean, clip 0.2/0.2, kl 0
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    curve: list[float] = []
    completions = gen_tokens = 0
    gen_time = 0.0
    reached = None
    t0 = time.perf_counter()
    for step in range(1, w.steps + 1):
        prompts = task.make_prompts(rng, w.prompts_per_step)
        prompt_ids = [torch.tensor(tokenizer(p.text)["input_ids"], dtype=torch.int64) for p in prompts]
        batch_prompts = [i for i in range(len(prompts)) for _ in range(w.generations)]
        tg = time.perf_counter()
        gens = rollout.generate(
            [prompt_ids[i] for i in batch_prompts], max_new_tokens=w.max_new_tokens, temperature=1.0,
            generator=generator,
        )
        gen_time += time.perf_counter() - tg
        rewards = [
            task.reward(prompts[i].text, "", g.response_ids.tolist(), prompts[i].answer, **prompts[i].metadata)
            for i, g in zip(batch_prompts, gens, strict=True)
        ]
        advantages = group_advantages(torch.tensor(rewards), torch.tensor(batch_prompts))
        samples = [
            TrainSample(prompt_ids[i], g.response_ids, float(a), rollout_logprobs=g.logprobs)
            for i, g, a in zip(batch_prompts, gens, advantages.tolist(), strict=True)
        ]
        size = micro_batch or len(samples)
        for start in range(0, len(samples), size):  # streamed: normalised at step()
            trainer.accumulate(samples[start : start + size], loss_config)
        stats = trainer.step()
        rollout_model.load_state_dict(trainer.full_state_dict(), strict=True)
        mean_reward = sum(rewards) / len(rewards)
        curve.append(mean_reward)
        completions += len(gens)
        gen_tokens += sum(g.response_ids.numel() for g in gens)
        if log_every and (step % log_every == 0 or step == 1):
            print(f"  [{w.name} seed {seed}] step {step:4d} reward {mean_reward:.3f} loss {stats['loss']:+.4f} "
                  f"grad_norm {stats['grad_norm']:.3f} entropy {stats['entropy']:.3f}", flush=True)
        if w.stop_reward is not None and mean_reward >= w.stop_reward:
            reached = step
            break
    wall = time.perf_counter() - t0
    return {
        "steps": len(curve),
        "wall_s": wall,
        "first_step_reward_ge_0.9": reached,
        "completions_per_s": completions / wall,
        "gen_tokens_per_s": gen_tokens / wall,
        "gen_fraction": gen_time / wall,
        "reward_last": curve[-1],
        "reward_curve": [round(r, 4) for r in curve],
    }


def run_trl(w: Workload, seed: int = 0, threads: int = 0) -> dict | None:
    cmd = [str(TRL_PYTHON), str(TRL_SCRIPT), *w.trl_args, "--seed", str(seed), "--print-every", "0",
           "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT_JSON "):
            return json.loads(line[len("RESULT_JSON "):])
    print(f"TRL run failed (rc {proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
    return None


def _reached(runs: list[dict], key: str) -> list[float]:
    return [r[key] for r in runs if r.get("first_step_reward_ge_0.9")]


def _ratio(ours: dict, theirs: dict, key: str = "median") -> float | None:
    if not ours.get("n") or not theirs.get("n") or not theirs[key]:
        return None
    return round(ours[key] / theirs[key], 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["W1", "W2", "both"], default="both")
    p.add_argument("--repeats", type=int, default=3, help="runs per side and workload (interleaved)")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL side even if its venv exists")
    p.add_argument("--learn-seeds", type=int, nargs="*", default=[1, 2, 3],
                   help="extra W1 seeds (streamrl only) to check that digits-max reaches 0.9")
    p.add_argument("--micro-batch", type=int, default=0, help="samples per accumulate() (0 = whole batch)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads on both sides (0 = torch default); 1 is robust on a busy machine")
    p.add_argument("--omp-passive", action="store_true",
                   help="OMP_WAIT_POLICY=PASSIVE on both sides (re-executes this script): on a busy machine, "
                        "spinning OpenMP threads wait for descheduled partners at every op")
    p.add_argument("--log-every", type=int, default=0)
    args = p.parse_args()
    if args.omp_passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read when OpenMP starts: start afresh; TRL inherits it
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.threads:
        torch.set_num_threads(args.threads)
    # the train engine is FSDP2 over a world of one process
    store_dir = tempfile.mkdtemp(prefix="streamrl-engine-only-")
    dist.init_process_group("gloo", store=dist.FileStore(f"{store_dir}/store", 1), rank=0, world_size=1)
    use_trl = not args.no_trl and TRL_PYTHON.exists() and TRL_SCRIPT.exists()
    workloads = {"W1": [W1], "W2": [W2], "both": [W1, W2]}[args.workload]

    figures: dict = {}
    baseline: dict = {}
    ratio: dict = {}
    for w in workloads:
        ours, theirs = [], []
        for r in range(args.repeats):  # interleaved, so machine noise hits both sides alike
            res = run_streamrl(w, seed=0, micro_batch=args.micro_batch, log_every=args.log_every)
            ours.append(res)
            print(f"{w.name} streamrl run {r + 1}: steps {res['steps']} wall {res['wall_s']:.2f}s "
                  f"completions/s {res['completions_per_s']:.1f} tokens/s {res['gen_tokens_per_s']:.0f} "
                  f"gen share {res['gen_fraction']:.2f} reached 0.9 at {res['first_step_reward_ge_0.9']}", flush=True)
            if use_trl:
                t = run_trl(w, seed=0, threads=args.threads)
                if t is not None:
                    theirs.append(t)
                    print(f"{w.name} TRL      run {r + 1}: steps {t['steps']} wall {t['wall_s']:.2f}s "
                          f"completions/s {t['completions_per_s']:.1f} tokens/s {t['gen_tokens_per_s']:.0f} "
                          f"reached 0.9 at {t['first_step_reward_ge_0.9']}", flush=True)
        sides = [(figures, ours)] + ([(baseline, theirs)] if theirs else [])
        if w.name == "W1":
            for out, runs in sides:
                out["W1"] = {
                    "steps_to_0.9": spread(_reached(runs, "first_step_reward_ge_0.9")),
                    "seconds_to_0.9": spread(_reached(runs, "wall_s")),
                    "not_reached": sum(1 for r in runs if not r["first_step_reward_ge_0.9"]),
                    "completions_per_s": spread(r["completions_per_s"] for r in runs),
                }
            learn = {}
            for seed in args.learn_seeds:
                res = run_streamrl(w, seed=seed, micro_batch=args.micro_batch)
                learn[str(seed)] = {"steps_to_0.9": res["first_step_reward_ge_0.9"], "wall_s": round(res["wall_s"], 2)}
                print(f"W1 streamrl seed {seed}: reached 0.9 at step {res['first_step_reward_ge_0.9']} "
                      f"in {res['wall_s']:.2f}s", flush=True)
            figures["W1"]["learn_seeds"] = learn
            if theirs:
                # Speed-up: TRL's seconds over ours (> 1 = streamrl faster).
                sec = _ratio(baseline["W1"]["seconds_to_0.9"], figures["W1"]["seconds_to_0.9"])
                ratio["W1_seconds_to_0.9_speedup"] = sec
                ratio["W1_seconds_to_0.9_speedup_best"] = _ratio(baseline["W1"]["seconds_to_0.9"],
                                                                 figures["W1"]["seconds_to_0.9"], "min")
                ratio["W1_completions_per_s"] = _ratio(figures["W1"]["completions_per_s"],
                                                       baseline["W1"]["completions_per_s"])
        else:
            for out, runs in sides:
                out["W2"] = {
                    "completions_per_s": spread(r["completions_per_s"] for r in runs),
                    "gen_tokens_per_s": spread(r["gen_tokens_per_s"] for r in runs),
                    "gen_fraction": spread(r["gen_fraction"] for r in runs),
                }
            if theirs:
                ratio["W2_completions_per_s"] = _ratio(figures["W2"]["completions_per_s"],
                                                       baseline["W2"]["completions_per_s"])
                # Best run of each side: the least disturbed one on a shared machine.
                ratio["W2_completions_per_s_best"] = _ratio(figures["W2"]["completions_per_s"],
                                                            baseline["W2"]["completions_per_s"], "max")
                ratio["W2_gen_tokens_per_s"] = _ratio(figures["W2"]["gen_tokens_per_s"],
                                                      baseline["W2"]["gen_tokens_per_s"])
    print_json_line(
        "engine_only", figures,
        baseline if baseline else {"note": "TRL not run" if not use_trl else "TRL runs failed"},
        ratio,
        {"W2_completions_per_s": ">= 2.0 (x TRL)", "W1": "mean reward >= 0.9 (TRL: step 72)"},
        threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
    )


if __name__ == "__main__":
    main()
