#!/usr/bin/env python3
"""FSDP2 train engine over R ranks vs the same engine in one process: step time and bytes per rank.

Two columns, one run, the same seeded Qwen2 model (float32) and the same GRPO-like global batch
(``--prompts`` prompts x ``--group`` completions, prompts of ``--prompt-len`` tokens, responses of
random lengths in [``--min-response``, ``--max-response``], random advantages and rollout
logprobs, token-mean loss ``LossConfig()``), AdamW lr 1e-3, max grad norm 1.0:

* ``fsdp2``: :class:`streamrl.engines.fsdp.FSDPTrainEngine` over R=``--world`` gloo processes, each
  with ``--threads`` torch threads, every rank taking batch / R samples in micro-batches of
  ``--micro-batch`` (``accumulate`` per micro-batch, then ``step``);
* ``one_process``: ``FSDPTrainEngine`` in a world of 1 (one process, ``--threads`` threads) on the
  whole batch, run after the R-rank world.

Forward: the engine's default, which computes each distinct prompt of a micro-batch once
(``packed``, where its start-up probe allows) and logits only at response positions;
``--fsdp-padded`` turns packing off (right-padded prompt+response rows) in both columns. The
"forward" column says which path each took.

Per column: the time of one optimizer step (all its micro-batches' forward+backward and the step;
the slowest rank's, after a barrier), ``--warmup`` untimed steps then ``--steps`` timed ones,
median [min, max]; and the bytes per rank of parameters + gradients + optimizer moments (the
largest rank's, from ``memory_bytes()``), taken after the last timed step's backward, before its
optimizer step (when the gradients exist). Transients (gathered layers, activations) are not
counted. The step-0 loss and gradient norm of both columns are printed as a cross-check that
they compute the same step.

Target: FSDP2 bytes per rank / (one-process bytes / R + one decoder layer's unsharded parameter
bytes) <= 1.0. The step time of R ranks over one process is reported, without a target.

    python ops/bench/fsdp_engine.py                 # 26.1M parameters, 2 warm-up + 5 timed steps
    python ops/bench/fsdp_engine.py --steps 2 --warmup 1
    python ops/bench/fsdp_engine.py --quick         # tiny model, 2 steps: a smoke run
    python ops/bench/fsdp_engine.py --fsdp-padded   # right-padded rows instead of packed prompts
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from streamrl.algos.grpo import LossConfig
from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine
from streamrl.engines.samples import TrainSample

try:
    from ops.bench._common import fmt_spread, print_json_line, print_table, spread
    from ops.bench.reshard import model_config as reshard_model_config
except ImportError:  # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import fmt_spread, print_json_line, print_table, spread
    from reshard import model_config as reshard_model_config

LR = 1e-3
MAX_GRAD_NORM = 1.0
LOSS = LossConfig()  # token-mean, clip 0.2, no KL
LABELS = {"fsdp2": "FSDP2", "one_process": "FSDP2, one process"}
QUICK = {
    "vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
    "prompts": 4, "group": 4, "prompt_len": 8, "min_response": 2, "max_response": 8, "micro_batch": 4,
    "steps": 2, "warmup": 1,
}
MIB = 2**20


# -- model and batch ----------------------------------------------------------------------------------
def model_config(args: argparse.Namespace) -> Qwen2Config:
    """The reshard benchmark's Qwen2, with enough positions for this benchmark's sequences."""
    config = reshard_model_config(args)
    config.max_position_embeddings = max(64, args.prompt_len + args.max_response)
    return config


def build_model(config: Qwen2Config, seed: int) -> PreTrainedModel:
    """The same random float32 model in every process (seeded init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config).float()


def model_sizes(config: Qwen2Config) -> tuple[int, int]:
    """(parameters of the model, float32 bytes of one decoder layer's unsharded parameters)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    return sum(p.numel() for p in model.parameters()), sum(p.numel() * 4 for p in layer.parameters())


def global_batch(args: argparse.Namespace) -> list[TrainSample]:
    """The step's samples, prompt-major (a prompt's completions side by side), the same in every process."""
    g = torch.Generator().manual_seed(args.seed + 1)
    samples = []
    for _ in range(args.prompts):
        prompt = torch.randint(1, args.vocab, (args.prompt_len,), generator=g)
        for _ in range(args.group):
            n = int(torch.randint(args.min_response, args.max_response + 1, (1,), generator=g))
            response = torch.randint(1, args.vocab, (n,), generator=g)
            rollout = -1.0 - torch.rand(n, generator=g) * 4.0  # behaviour logprobs in [-5, -1]
            advantage = float(torch.randn((), generator=g))
            samples.append(TrainSample(prompt, response, advantage, rollout_logprobs=rollout))
    return samples


def rank_micro_batches(samples: list[TrainSample], rank: int, world: int, size: int) -> list[list[TrainSample]]:
    """This rank's contiguous share of the global batch, in micro-batches of ``size``."""
    per = len(samples) // world
    mine = samples[rank * per : (rank + 1) * per]
    return [mine[i : i + size] for i in range(0, len(mine), size)]


# -- the engine, driven one optimizer step at a time ------------------------------------------------------
def rank_main(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """``FSDPTrainEngine`` on this rank, ``accumulate`` per micro-batch then ``step``: this rank's
    timed step seconds, its memory at the last timed step, the step-0 loss and gradient norm."""
    engine = FSDPTrainEngine(
        build_model(model_config(args), args.seed), lr=LR, max_grad_norm=MAX_GRAD_NORM, device="cpu",
        options=FSDPOptions(pack_prompts=not args.fsdp_padded),
    )
    micro_batches = rank_micro_batches(global_batch(args), rank, world, args.micro_batch)
    out: dict[str, Any] = {"seconds": [], "forward_path": engine.forward_path}
    total = args.warmup + args.steps
    for step in range(total):
        dist.barrier()
        t0 = time.perf_counter()
        for mb in micro_batches:
            engine.accumulate(mb, LOSS)
        t1 = time.perf_counter()
        if step == total - 1:  # gradients exist, the optimizer has not stepped; not timed
            out["memory"] = engine.memory_bytes()
        t2 = time.perf_counter()
        stats = engine.step()
        t3 = time.perf_counter()
        if step == 0:
            out["step0"] = {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}
        if step >= args.warmup:
            out["seconds"].append((t1 - t0) + (t3 - t2))
    return out


# -- worlds of spawned processes --------------------------------------------------------------------------
def _entry(rank: int, world: int, args: argparse.Namespace, workdir: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
        timeout=timedelta(seconds=args.timeout_s),
    )
    path = Path(workdir, f"result-{rank}.json")
    try:
        path.write_text(json.dumps({"ok": True, "value": rank_main(rank, world, args)}))
    except BaseException:
        path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """:func:`rank_main` on ``world`` spawned gloo ranks (FileStore in a temporary directory); the
    results by rank. A rank's failure or an overrun of ``--timeout-s`` raises; every process is
    stopped and joined before this returns."""
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-fsdp-") as workdir:
        context = mp.start_processes(
            _entry, args=(world, args, workdir), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + args.timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the world of {world} ranks overran --timeout-s={args.timeout_s}")
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank of the world of {world} failed:\n{_errors(workdir, world) or exc}") from None
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a rank of the world of {world} died: {exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=30)
        results = []
        for rank in range(world):
            record = json.loads(Path(workdir, f"result-{rank}.json").read_text())
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["value"])
        return results


def _errors(workdir: str, world: int) -> str:
    out = []
    for rank in range(world):
        path = Path(workdir, f"result-{rank}.json")
        if path.exists():
            record = json.loads(path.read_text())
            if not record["ok"]:
                out.append(f"--- rank {rank} ---\n{record['error']}")
    return "\n".join(out)


def combine(by_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A world's figures from its ranks: the slowest rank's time per step, the largest rank's bytes."""
    per_step = [max(r["seconds"][i] for r in by_rank) for i in range(len(by_rank[0]["seconds"]))]
    memory = max((r["memory"] for r in by_rank), key=lambda m: sum(m.values()))
    return {
        "R": len(by_rank),
        "step_ms": spread(s * 1e3 for s in per_step),
        "bytes_per_rank": sum(memory.values()),
        "memory_bytes": memory,
        "step0_loss": by_rank[0]["step0"]["loss"],
        "step0_grad_norm": by_rank[0]["step0"]["grad_norm"],
        "forward_path": by_rank[0]["forward_path"],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks R of the fsdp2 column")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (and of the one process)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per column")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a small batch, 2 steps: a smoke run")
    parser.add_argument("--fsdp-padded", action="store_true",
                        help="right-padded prompt+response rows (pack_prompts off) in both columns; by default "
                        "each shared prompt is computed once (the engine's default)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of each world (and its collectives)")
    parser.add_argument("--seed", type=int, default=0)
    model = parser.add_argument_group("model (Qwen2, float32)")
    model.add_argument("--vocab", type=int, default=8192)
    model.add_argument("--hidden", type=int, default=512)
    model.add_argument("--intermediate", type=int, default=1408)
    model.add_argument("--layers", type=int, default=6)
    model.add_argument("--heads", type=int, default=8)
    model.add_argument("--kv-heads", type=int, default=4)
    batch = parser.add_argument_group("batch (GRPO-like)")
    batch.add_argument("--prompts", type=int, default=16)
    batch.add_argument("--group", type=int, default=4, help="completions per prompt")
    batch.add_argument("--prompt-len", type=int, default=32)
    batch.add_argument("--min-response", type=int, default=8)
    batch.add_argument("--max-response", type=int, default=32)
    batch.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch per rank")
    args = parser.parse_args()
    if args.quick:
        given = {a.dest for a in parser._actions for o in a.option_strings
                 if any(arg == o or arg.startswith(o + "=") for arg in sys.argv[1:])}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    samples = args.prompts * args.group
    if args.world < 1 or samples % args.world:
        parser.error(f"{args.prompts} x {args.group} = {samples} samples must divide over --world={args.world}")
    if not 1 <= args.min_response <= args.max_response:
        parser.error("need 1 <= --min-response <= --max-response")
    if args.steps < 1 or args.warmup < 0:
        parser.error("need --steps >= 1 and --warmup >= 0")
    return args


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_world's cleanup: no rank is left behind


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args()
    R = args.world
    config = model_config(args)
    params, layer_bytes = model_sizes(config)
    batch = global_batch(args)
    tokens = sum(s.response_ids.numel() for s in batch)
    print(
        f"fsdp engine benchmark: Qwen2 {params / 1e6:.2f}M params ({params:,}) fp32, hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}; batch {args.prompts} prompts x {args.group} "
        f"({len(batch)} samples, prompt {args.prompt_len}, {tokens} response tokens), micro-batches of "
        f"{args.micro_batch} per rank; R={R}, {args.threads} thread(s) per rank; {args.warmup} warm-up + "
        f"{args.steps} timed steps",
        flush=True,
    )
    started = time.perf_counter()
    figures = {"fsdp2": combine(run_world(R, args)), "one_process": combine(run_world(1, args))}
    wall = time.perf_counter() - started

    rows = []
    for name, f in figures.items():
        m = f["memory_bytes"]
        rows.append([
            LABELS[name], f["R"], fmt_spread(f["step_ms"]), f"{m['parameters'] / MIB:.1f}",
            f"{m['gradients'] / MIB:.1f}", f"{m['optimizer'] / MIB:.1f}", f"{f['bytes_per_rank'] / MIB:.1f}",
            f"{f['step0_loss']:.6f} / {f['step0_grad_norm']:.4f}", f["forward_path"],
        ])
    print_table(["engine", "R", "step ms [min, max]", "params MiB", "grads MiB", "optimizer MiB",
                 "total MiB/rank", "step-0 loss / grad norm", "forward"], rows)

    fsdp, one = figures["fsdp2"], figures["one_process"]
    ideal = one["bytes_per_rank"] / R + layer_bytes
    ratio = {
        "bytes_per_rank_vs_one_process_share_plus_layer": fsdp["bytes_per_rank"] / ideal,
        "step_time_vs_one_process": fsdp["step_ms"]["median"] / one["step_ms"]["median"],
    }
    loss_diff = abs(fsdp["step0_loss"] - one["step0_loss"])
    target = {"bytes_per_rank_vs_one_process_share_plus_layer_max": 1.0}
    met = {"bytes_per_rank": ratio["bytes_per_rank_vs_one_process_share_plus_layer"] <= 1.0}
    print(f"FSDP2 bytes per rank / (one process / R + one layer {layer_bytes / MIB:.2f} MiB = {ideal / MIB:.1f} MiB): "
          f"{ratio['bytes_per_rank_vs_one_process_share_plus_layer']:.3f} (target <= 1.0); "
          f"FSDP2 R={R} step time / one process: {ratio['step_time_vs_one_process']:.3f}")
    print(f"step-0 losses agree within {loss_diff:.2e}; wall {wall:.0f} s")

    print_json_line(
        "fsdp_engine",
        {"fsdp2": fsdp},
        {"one_process": one},
        ratio,
        target,
        met=met,
        params=params,
        layer_param_bytes=layer_bytes,
        train_ranks=R,
        threads_per_rank=args.threads,
        batch={"prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
               "response_len": [args.min_response, args.max_response], "response_tokens": tokens,
               "micro_batch": args.micro_batch, "loss": "token-mean"},
        steps={"warmup": args.warmup, "timed": args.steps},
        fsdp_pack_prompts=not args.fsdp_padded,
        step0_loss_max_diff=loss_diff if math.isfinite(loss_diff) else None,
    )


if __name__ == "__main__":
    main()
