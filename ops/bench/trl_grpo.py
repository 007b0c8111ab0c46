#!/usr/bin/env python3
"""Hugging Face TRL's GRPOTrainer on streamrl's own model, tokenizer and digit tasks (CPU, fp32).

The TRL side of ``ops/bench/grpo_vs_trl.py`` (and of ``ops/bench/engine_only.py``). It runs in its
own virtual environment, made by ``bash ops/bench/setup_trl_env.sh [VENV_DIR]``:

    VENV/bin/python ops/bench/trl_grpo.py --task max --steps 300 --stop-reward 0.9          # W1
    VENV/bin/python ops/bench/trl_grpo.py --task reverse --n-digits 24 --min-digits 2 \\
        --max-completion-length 32 --hidden 256 --layers 4 --heads 8 --intermediate 512 \\
        --prompts-per-step 16 --num-generations 8 --steps 15                                # W2

Both sides of the comparison use the same pieces, imported from this checkout (the repository root
is put first on ``sys.path``, so no streamrl install is needed in the venv):
- model: ``streamrl.models.build.build_model`` (tiny Qwen2 from a config, random init seeded by
  ``--seed``); the SHA-256 of the initial weights is reported so a caller can check both sides
  start from the very same weights;
- tokenizer: ``streamrl.models.tokenizer.build_char_tokenizer`` (one token per character);
- prompts and rewards: ``streamrl.tasks.digits`` (``--task max`` = ``digits-max``, ``reverse`` =
  ``digits-reverse``, ...), prompts drawn from ``random.Random(--seed)``.

TRL settings (the workloads' common ground, docs/benchmarks.md §1): fp32 on CPU, AdamW with a
constant learning rate, max grad norm 1.0, temperature 1.0, no top-p/top-k, KL coefficient
``--beta`` (0), clip 0.2, one update per generation batch, group-normalised advantages,
token-mean ("dapo") loss. One optimizer step = prompts-per-step x num-generations completions.

Measured: the training loop only (``trainer.train()``; building the model and trainer excluded),
per-step times, time inside generation, and the reward of every step. The last line printed is
``RESULT_JSON {...}``; ``<out>/curve.csv`` and ``<out>/result.json`` hold the same.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, TrainerCallback

    from streamrl.tasks.base import Task

ROOT = Path(__file__).resolve().parents[2]

# The package versions the reference TRL figures in docs/benchmarks.md were taken with; the setup
# script installs exactly these. Other versions run, with a warning: their figures do not compare.
REFERENCE_VERSIONS: dict[str, str] = {
    "torch": "2.13.0",
    "trl": "1.16.0",
    "transformers": "5.23.0",
    "accelerate": "1.15.0",
    "datasets": "5.2.0",
    "tokenizers": "0.23.3",
}

# --task name here -> streamrl task name (the short names are the ones the workloads always used).
TASK_NAMES: dict[str, str] = {
    "max": "digits-max",
    "last": "digits-last",
    "sum": "digits-sum",
    "reverse": "digits-reverse",
}


class TrlEnvironmentError(RuntimeError):
    """This interpreter cannot run the benchmark (TRL or streamrl's modules do not import)."""


class BenchArgumentError(ValueError):
    """The flags describe a run that cannot work (e.g. prompt + completion longer than the positions)."""


def _prepare_environment() -> None:
    """Offline and quiet Hugging Face libraries, and this checkout's streamrl first on the path.

    Called before transformers is imported: huggingface_hub reads the offline switches at import.
    """
    for key, value in {
        "HF_HUB_OFFLINE": "1",  # the model and tokenizer are built in code: nothing to fetch
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",  # no Rust thread pool competing with torch's threads
        "WANDB_DISABLED": "true",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }.items():
        os.environ.setdefault(key, value)
    # The checkout beside this file wins over any streamrl installed in the venv, so the TRL side
    # always uses the same model/tokenizer/task code as the streamrl side it is compared with.
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    warnings.filterwarnings("ignore")  # TRL/transformers deprecation chatter would drown the progress lines


def _import_trl() -> None:
    """Fail early, naming the fix, when this interpreter is not the TRL venv."""
    missing = []
    # streamrl's modules last: they need msgspec, which the setup script installs beside TRL.
    for module in ("trl", "transformers", "accelerate", "datasets", "streamrl.models.build",
                   "streamrl.models.tokenizer", "streamrl.tasks.digits"):
        try:
            __import__(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
    if missing:
        raise TrlEnvironmentError(
            f"{sys.executable} cannot import {', '.join(missing)}. Make the TRL venv with "
            f"`bash {ROOT / 'ops/bench/setup_trl_env.sh'} [VENV_DIR]` and run this script with VENV_DIR/bin/python"
        )


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import tokenizers
    import transformers
    import trl

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
    }


def version_mismatches(found: dict[str, str]) -> list[str]:
    """Packages whose version differs from the reference figures' (local labels like +cpu ignored)."""
    return [f"{name} {found.get(name)} (reference {want})" for name, want in REFERENCE_VERSIONS.items()
            if found.get(name, "").split("+", 1)[0] != want]


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters and buffers (name order, fp32 bytes): equal digests = equal weights.

    ``grpo_vs_trl.py`` computes it for streamrl's model too, so a TRL venv whose torch initialises
    differently (another version) is caught instead of silently comparing two different models.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASK_NAMES), default="max",
                   help="max = digits-max, last = digits-last, sum = digits-sum, reverse = digits-reverse")
    p.add_argument("--n-digits", type=_positive_int, default=3,
                   help="digits per prompt (max/last/sum); the most digits (reverse)")
    p.add_argument("--min-digits", type=_positive_int, default=None,
                   help="reverse: the fewest digits per prompt (default: --n-digits)")
    p.add_argument("--steps", type=_positive_int, default=50, help="optimizer steps (TRL max_steps)")
    p.add_argument("--stop-reward", type=float, default=None,
                   help="stop once a step's mean reward >= this (default: run all --steps)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0 = no reference model)")
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group, >= 2)")
    p.add_argument("--prompts-per-step", type=_positive_int, default=8)
    p.add_argument("--max-completion-length", type=_positive_int, default=4, help="tokens per completion, at most")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="model init, prompts, sampling and data order")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                   help="torch.set_float32_matmul_precision (streamrl's model.matmul_precision, here for the whole "
                        "model, attention included)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype (streamrl's model.dtype): bfloat16 = TRL's bf16=True, autocast over float32 "
                        "weights and AdamW state")
    p.add_argument("--hidden", type=_positive_int, default=128)
    p.add_argument("--layers", type=_positive_int, default=2)
    p.add_argument("--heads", type=_positive_int, default=4)
    p.add_argument("--intermediate", type=_positive_int, default=256)
    p.add_argument("--max-positions", type=_positive_int, default=64, help="positions the model config advertises")
    p.add_argument("--dataset-size", type=_positive_int, default=20000,
                   help="prompts in the dataset (at least steps x prompts-per-step are made); it sets TRL's "
                        "data order, so keep it equal when comparing runs")
    p.add_argument("--out", type=Path, default=None, help="output dir (default: <tmp>/streamrl-trl-runs/<tag>)")
    p.add_argument("--tag", default=None, help="run name (default: task, seed and a timestamp)")
    p.add_argument("--print-every", type=int, default=10, help="a progress line every N steps (0 = silent)")
    p.add_argument("--check-env", action="store_true",
                   help="only check that this interpreter can run the benchmark (imports, versions) and exit")
    args = p.parse_args(argv)
    if args.num_generations < 2:
        p.error(f"--num-generations must be >= 2 (GRPO normalises rewards within a group), got {args.num_generations}")
    if args.min_digits is not None and args.task != "reverse":
        p.error(f"--min-digits applies to --task reverse only, got --task {args.task}")
    if args.min_digits is not None and args.min_digits > args.n_digits:
        p.error(f"--min-digits ({args.min_digits}) must be <= --n-digits ({args.n_digits})")
    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0 = torch's default), got {args.threads}")
    return args


def make_task(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> Task:
    from streamrl.tasks import get_task

    name = TASK_NAMES[args.task]
    if args.task == "reverse":
        options = {"min_digits": args.min_digits or args.n_digits, "max_digits": args.n_digits}
    else:
        options = {"n_digits": args.n_digits}
    return get_task(name, tokenizer=tokenizer, **options)


def make_dataset(task: Task, n: int, seed: int) -> tuple[Dataset, list[str]]:
    """``n`` prompts of ``task`` from ``random.Random(seed)`` as TRL's dataset: columns prompt, answer
    and each metadata field (TRL hands every extra column to the reward function)."""
    from datasets import Dataset

    prompts = task.make_prompts(seed, n)
    meta_keys = sorted(prompts[0].metadata) if prompts else []
    columns: dict[str, list[Any]] = {"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]}
    for key in meta_keys:
        columns[key] = [p.metadata[key] for p in prompts]
    return Dataset.from_dict(columns), meta_keys


class RewardRecorder:
    """The task's own reward, as TRL calls reward functions, recording each batch's mean and tokens.

    TRL calls it once per generation batch (= once per optimizer step here: one update per batch).
    """

    def __init__(self, task: Task, meta_keys: list[str]) -> None:
        self.task = task
        self.meta_keys = meta_keys
        self.batches: list[dict[str, float]] = []

    def reward_fn(self) -> Callable[..., list[float]]:
        def task_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                        answer: list[str], **columns: Any) -> list[float]:
            # TRL also passes its own keywords (e.g. trainer_state): keep only the task's metadata.
            metadata = [{k: columns[k][i] for k in self.meta_keys} for i in range(len(prompts))]
            rewards = self.task.reward_batch(prompts, completions, completion_ids, answer, metadata)
            self.batches.append({"n": len(rewards), "mean": sum(rewards) / len(rewards),
                                 "tokens": sum(len(ids) for ids in completion_ids)})
            return rewards

        return task_reward


def make_callback(stop_reward: float | None, step_times: list[float], logs_by_step: dict[int, dict[str, Any]],
                  print_every: int) -> TrainerCallback:
    from transformers import TrainerCallback

    class StepCallback(TrainerCallback):
        """Times each optimizer step, keeps TRL's per-step logs, stops at the target reward."""

        def __init__(self) -> None:
            self.t_begin = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t_begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            step_times.append(time.perf_counter() - self.t_begin)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            if not logs or "reward" not in logs:
                return
            step = state.global_step
            logs_by_step[step] = dict(logs)
            if print_every and (step % print_every == 0 or step == 1):
                print(f"step {step:4d}  reward {logs['reward']:.3f}  loss {logs.get('loss', float('nan')):+.4f}  "
                      f"entropy {logs.get('entropy', float('nan')):.3f}", flush=True)
            if stop_reward is not None and logs["reward"] >= stop_reward:
                control.should_training_stop = True

    return StepCallback()


def grpo_config(args: argparse.Namespace, out: Path) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trainer"),  # nothing is written there: save_strategy="no"
        use_cpu=True,
        bf16=args.dtype == "bfloat16",  # mixed precision: the weights and AdamW state stay float32
        fp16=False,
        gradient_checkpointing=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # TRL counts completions in its batch size: one step = prompts x generations, one update each.
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        beta=args.beta,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=args.steps,
        logging_steps=1,  # the per-step reward comes from the logs: one log per step
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_completions=False,
        model_init_kwargs={"dtype": "float32"},
    )


def _first_step_at_least(curve: list[float], threshold: float) -> int | None:
    return next((i + 1 for i, r in enumerate(curve) if r >= threshold), None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOTrainer

    from streamrl.models.build import TinyModelSpec, build_model, save_pretrained_dir
    from streamrl.models.tokenizer import build_char_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)
    hf_logging.disable_progress_bar()  # the save/load bars of the init weights would clutter the log
    tag = args.tag or f"{args.task}_seed{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    out = args.out or Path(tempfile.gettempdir()) / "streamrl-trl-runs" / tag
    out.mkdir(parents=True, exist_ok=True)

    t_setup = time.perf_counter()
    set_seed(args.seed)
    tokenizer = build_char_tokenizer()
    task = make_task(args, tokenizer)
    # The digit tasks say how long their longest prompt is; check it fits before TRL starts.
    longest = len(tokenizer(task.max_prompt_text())["input_ids"]) + args.max_completion_length  # type: ignore[attr-defined]
    if longest > args.max_positions:
        raise BenchArgumentError(
            f"the longest prompt ({longest - args.max_completion_length} tokens) + --max-completion-length "
            f"({args.max_completion_length}) = {longest} exceeds --max-positions ({args.max_positions}); "
            "raise --max-positions or shorten prompts/completions")
    spec = TinyModelSpec(hidden=args.hidden, layers=args.layers, heads=args.heads, intermediate=args.intermediate,
                         max_positions=args.max_positions, seed=args.seed)
    model = build_model(spec, tokenizer)
    init_sha = weights_sha256(model)
    n_params = sum(p.numel() for p in model.parameters())
    # TRL is given a directory, not the module: with --beta > 0 it builds the reference model from that
    # path, and the policy is then loaded the same way in both cases.
    model_dir = tempfile.TemporaryDirectory(prefix="streamrl-trl-init-")
    save_pretrained_dir(model, tokenizer, model_dir.name)
    del model

    dataset, meta_keys = make_dataset(task, max(args.dataset_size, args.steps * args.prompts_per_step), args.seed)
    recorder = RewardRecorder(task, meta_keys)
    cfg = grpo_config(args, out)
    step_times: list[float] = []
    logs_by_step: dict[int, dict[str, Any]] = {}
    trainer = GRPOTrainer(
        model=model_dir.name,
        reward_funcs=recorder.reward_fn(),
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[make_callback(args.stop_reward, step_times, logs_by_step, args.print_every)],
    )
    # The Trainer's own per-step dict printer and progress bar: our callback prints one compact line.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)

    # Time spent inside generation, to split the step into rollout and learning. The hook is TRL's
    # private generation method; if a TRL version renames it the run goes on without the split.
    gen = {"s": 0.0, "calls": 0}
    original = getattr(trainer, "_generate_single_turn", None)
    if original is not None:
        def timed_generate(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                gen["s"] += time.perf_counter() - t0
                gen["calls"] += 1

        trainer._generate_single_turn = timed_generate  # type: ignore[method-assign]
    else:
        print("note: this TRL has no _generate_single_turn; generation time is not split out", file=sys.stderr)
    setup_s = time.perf_counter() - t_setup

    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    model_dir.cleanup()

    curve = [b["mean"] for b in recorder.batches]
    completions = int(sum(b["n"] for b in recorder.batches))
    gen_tokens = int(sum(b["tokens"] for b in recorder.batches))
    steps = trainer.state.global_step
    batch = args.prompts_per_step * args.num_generations
    with open(out / "curve.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "mean_reward", "reward_std", "loss", "kl", "entropy", "mean_completion_len",
                    "gen_tokens", "step_time_s"])
        for i, b in enumerate(recorder.batches):
            logs = logs_by_step.get(i + 1, {})
            w.writerow([i + 1, f"{b['mean']:.6f}", logs.get("reward_std", ""), logs.get("loss", ""),
                        logs.get("kl", ""), logs.get("entropy", ""), logs.get("completions/mean_length", ""),
                        int(b["tokens"]), f"{step_times[i]:.5f}" if i < len(step_times) else ""])
    # The first step includes one-off warm-up (allocations, lazy inits): the steady rate leaves it out.
    steady = step_times[1:] if len(step_times) > 1 else step_times
    found = versions()
    return {
        "tag": tag,
        "runner": "ops/bench/trl_grpo.py",
        "framework": "trl.GRPOTrainer",
        "versions": found,
        "version_mismatches": version_mismatches(found),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "model": {"arch": "Qwen2ForCausalLM", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "intermediate": args.intermediate, "vocab": len(tokenizer), "params": n_params,
                  "dtype": args.dtype, "init_weights_sha256": init_sha},
        "config": {"task": args.task, "streamrl_task": task.name, "n_digits": args.n_digits,
                   "min_digits": args.min_digits, "num_generations": args.num_generations,
                   "prompts_per_step": args.prompts_per_step, "completions_per_step": batch,
                   "max_completion_length": args.max_completion_length, "temperature": args.temperature,
                   "lr": args.lr, "lr_schedule": "constant", "beta": args.beta, "loss_type": "dapo",
                   "scale_rewards": "group", "num_iterations": 1, "epsilon": 0.2, "optimizer": str(cfg.optim),
                   "max_grad_norm": 1.0, "steps": args.steps, "stop_reward": args.stop_reward, "seed": args.seed,
                   "dataset_size": len(dataset)},
        "steps": steps,
        "setup_s": round(setup_s, 3),
        "wall_s": round(wall, 3),
        "completions": completions,
        "gen_tokens": gen_tokens,
        "completions_per_s": round(completions / wall, 2),
        "gen_tokens_per_s": round(gen_tokens / wall, 2),
        "steps_per_s": round(steps / wall, 4),
        "steady_steps_per_s": round(len(steady) / sum(steady), 4) if steady else None,
        "steady_completions_per_s": round(len(steady) * batch / sum(steady), 2) if steady else None,
        "gen_time_s": round(gen["s"], 3) if original is not None else None,
        "gen_fraction": round(gen["s"] / wall, 4) if original is not None else None,
        "reward_first": curve[0] if curve else None,
        "reward_last": curve[-1] if curve else None,
        "reward_last10_mean": round(sum(curve[-10:]) / len(curve[-10:]), 4) if curve else None,
        "reward_max": max(curve) if curve else None,
        "first_step_reward_ge_0.5": _first_step_at_least(curve, 0.5),
        "first_step_reward_ge_0.9": _first_step_at_least(curve, 0.9),
        "reward_curve": [round(r, 4) for r in curve],
        "curve_csv": str(out / "curve.csv"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _prepare_environment()
    try:
        _import_trl()
    except TrlEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    mismatches = version_mismatches(versions())
    if mismatches:
        print("warning: versions differ from the reference figures': " + "; ".join(mismatches)
              + " (make the venv with ops/bench/setup_trl_env.sh for comparable figures)", file=sys.stderr)
    if args.check_env:
        print(json.dumps({"python": sys.executable, "versions": versions(), "version_mismatches": mismatches,
                          "streamrl_root": str(ROOT)}))
        return 0
    try:
        result = run(args)
    except BenchArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import resource

    result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # (KiB on Linux)
    out = Path(result["curve_csv"]).parent
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print("RESULT_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
