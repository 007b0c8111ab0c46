#!/usr/bin/env python3
"""FSDP2 train engine vs the hand-written sharded engine vs one process: step time and bytes per rank.

Three columns, one run, the same seeded Qwen2 model (float32) and the same GRPO-like global batch
(``--prompts`` prompts x ``--group`` completions, prompts of ``--prompt-len`` tokens, responses of
random lengths in [``--min-response``, ``--max-response``], random advantages and rollout
logprobs, token-mean loss ``LossConfig()``), AdamW lr 1e-3, max grad norm 1.0:

* ``fsdp2``: :class:`streamrl.engines.fsdp.FSDPTrainEngine` over R=``--world`` gloo processes, each
  with ``--threads`` torch threads, every rank taking batch / R samples in micro-batches of
  ``--micro-batch`` (``accumulate`` per micro-batch, then ``step``);
* ``hand_written``: the hand-written :class:`streamrl.reshard.train_engine.ShardedTrainEngine` in the
  same processes (``forward_backward`` per micro-batch with the GRPO loss, then
  ``optimizer_step``), driven as the removed ``streamrl/stages/sharded_grpo.py`` trainer drove it;
  its helpers are copied below. When the engine is no longer in the tree the column is skipped
  (said in the table and in the JSON line) and the recorded figures stay in the docs;
* ``one_process``: ``FSDPTrainEngine`` in a world of 1 (one process, ``--threads`` threads) on the
  whole batch.

Forward: FSDP2 runs the engine's default, which computes each distinct prompt of a micro-batch
once (``packed``, where its start-up probe allows) and logits only at response positions; the
hand-written engine runs right-padded prompt+response rows and logits at every position.
``--fsdp-padded`` turns packing off in FSDP2 for a like-for-like forward. The "forward" column
says which path each engine took.

The two R-rank engines run interleaved in one world (the order alternating each step) so that a
busy machine slows both alike; the one-process engine runs after, in its own world.

Per engine: the time of one optimizer step (all its micro-batches' forward+backward and the step;
the slowest rank's, after a barrier), ``--warmup`` untimed steps then ``--steps`` timed ones,
median [min, max]; and the bytes per rank of parameters + gradients + optimizer moments (the
largest rank's), taken after the last timed step's backward, before its optimizer step (when the
gradients exist). FSDP2's from ``memory_bytes()``; the hand-written engine's from its padded
shards, their gradients and its AdamW state. Transients (gathered layers / the hand-written
engine's whole gathered model, activations) are not counted. The step-0 loss and gradient norm of
every engine are printed as a cross-check that all three compute the same step.

Ratios and targets: FSDP2 step time / hand-written step time <= 1.0; FSDP2 bytes per rank /
(one-process bytes / R + one decoder layer's unsharded parameter bytes) <= 1.0.

    python ops/bench/fsdp_engine.py                 # 26.1M parameters, 2 warm-up + 5 timed steps
    python ops/bench/fsdp_engine.py --steps 2 --warmup 1
    python ops/bench/fsdp_engine.py --quick         # tiny model, 2 steps: a smoke run
    python ops/bench/fsdp_engine.py --no-hand-written
    python ops/bench/fsdp_engine.py --fsdp-padded   # FSDP2 on padded rows too: same forward as the baseline
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
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from streamrl.algos.grpo import LossConfig, loss_denominator, per_token_loss, unnormalized_loss
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
ENGINES = ("fsdp2", "hand_written", "one_process")
LABELS = {"fsdp2": "FSDP2", "hand_written": "hand-written sharded", "one_process": "FSDP2, one process"}
QUICK = {
    "vocab": 256, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
    "prompts": 4, "group": 4, "prompt_len": 8, "min_response": 2, "max_response": 8, "micro_batch": 4,
    "steps": 2, "warmup": 1,
}
MIB = 2**20


# -- the hand-written engine: optional (it is about to leave the tree) --------------------------------
def hand_written_missing() -> str | None:
    """None when the hand-written engine can be imported, else why not."""
    try:
        import streamrl.reshard.train_engine  # noqa: F401
    except ImportError as exc:
        return f"streamrl.reshard.train_engine is not importable ({exc})"
    return None


def grpo_micro_batch(samples: Sequence[TrainSample]) -> dict[str, Tensor]:
    """Right-padded prompt+response rows for the Hugging Face forward, and where each response
    token's logit sits (from the removed ``streamrl/stages/sharded_grpo.py``, taking samples
    instead of dock columns)."""
    inputs = [torch.cat([s.prompt_ids, s.response_ids[:-1]]) for s in samples]
    lengths = torch.tensor([x.numel() for x in inputs])
    width = int(lengths.max())
    resp_lens = torch.tensor([s.response_ids.numel() for s in samples])
    seq_index = torch.repeat_interleave(torch.arange(len(samples)), resp_lens)
    offset = torch.arange(seq_index.numel()) - (resp_lens.cumsum(0) - resp_lens)[seq_index]
    first = torch.tensor([s.prompt_ids.numel() - 1 for s in samples])
    batch = {
        "input_ids": torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True),
        "attention_mask": (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long(),
        "rows": seq_index * width + first[seq_index] + offset,
        "targets": torch.cat([s.response_ids for s in samples]),
        "seq_index": seq_index,
        "n_seqs": torch.tensor(len(samples)),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32)[seq_index],
    }
    for name in ("rollout_logprobs", "ref_logprobs"):
        values = [getattr(s, name) for s in samples]
        if all(v is not None for v in values):
            batch[name] = torch.cat(values).float()
    return batch


class GrpoLossFn:
    """``ShardedTrainEngine.forward_backward``'s loss: the GRPO per-token loss summed unnormalised
    (the step's denominator goes in through ``loss_scale``), with the loss sum for the report
    (from the removed ``streamrl/stages/sharded_grpo.py``, statistics trimmed to the loss)."""

    def __init__(self, config: LossConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.loss_sum = 0.0

    def __call__(self, logits: Tensor, b: Mapping[str, Tensor]) -> Tensor:
        cfg, device = self.config, self.device
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, b["rows"].to(device))
        logp_all = torch.log_softmax(flat.float() / cfg.temperature, dim=-1)
        logp = logp_all.gather(1, b["targets"].to(device).unsqueeze(1)).squeeze(1)
        optional = {k: b[k].to(device) for k in ("rollout_logprobs", "ref_logprobs") if k in b}
        per_token, _ = per_token_loss(logp, b["advantages"].to(device), cfg, **optional)
        loss = unnormalized_loss(per_token, b["seq_index"].to(device), int(b["n_seqs"]), cfg.loss_agg)
        self.loss_sum += float(loss.detach())
        return loss


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


# -- the engines, driven one optimizer step at a time -----------------------------------------------------
StepResult = tuple[float, dict[str, int] | None, dict[str, float]]  # seconds, memory (or None), loss/grad norm


class FsdpRunner:
    """``FSDPTrainEngine``: ``accumulate`` per micro-batch, then ``step``."""

    def __init__(self, config: Qwen2Config, micro_batches: list[list[TrainSample]], args: argparse.Namespace) -> None:
        self.engine = FSDPTrainEngine(
            build_model(config, args.seed), lr=LR, max_grad_norm=MAX_GRAD_NORM, device="cpu",
            options=FSDPOptions(pack_prompts=not args.fsdp_padded),
        )
        self.micro_batches = micro_batches

    def step(self, measure: bool) -> StepResult:
        t0 = time.perf_counter()
        for mb in self.micro_batches:
            self.engine.accumulate(mb, LOSS)
        t1 = time.perf_counter()
        memory = self.engine.memory_bytes() if measure else None
        t2 = time.perf_counter()
        stats = self.engine.step()
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), memory, {"loss": stats["loss"], "grad_norm": stats["grad_norm"]}

    def info(self) -> dict[str, Any]:
        return {"forward_path": self.engine.forward_path}


class HandWrittenRunner:
    """``ShardedTrainEngine`` as the removed sharded GRPO trainer drove it: the step's token count
    all-reduced, ``forward_backward(grpo_micro_batch(...), GrpoLossFn, loss_scale=dp / tokens)``
    per micro-batch, then ``optimizer_step``."""

    def __init__(self, config: Qwen2Config, micro_batches: list[list[TrainSample]], args: argparse.Namespace) -> None:
        from streamrl.reshard.train_engine import AdamWConfig, ShardedTrainEngine

        from streamrl.reshard import ModelShardingSpec, Topology, TrainLayout, build_rank_groups

        spec = ModelShardingSpec.from_config(config)
        groups = build_rank_groups(Topology.colocated(TrainLayout(dist.get_world_size()), 1)).train
        assert groups is not None
        self.engine: Any = ShardedTrainEngine(
            build_model(config, args.seed), spec, groups,
            optimizer=AdamWConfig(lr=LR, max_grad_norm=MAX_GRAD_NORM), device="cpu",
        )
        self.group, self.dp = groups.group, groups.layout.data_parallel
        self.micro_batches = micro_batches
        self.counts = [float(sum(s.response_ids.numel() for mb in micro_batches for s in mb)),
                       float(sum(len(mb) for mb in micro_batches))]

    def _all_reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this rank's (padded) parameter shards, their gradients and the AdamW moments."""
        def size(tensors: list[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        shards = list(self.engine.shards.values())
        moments = [v for state in self.engine.optimizer.state.values() for v in state.values()
                   if isinstance(v, Tensor) and v.dim() > 0]
        return {"parameters": size([p.data for p in shards]),
                "gradients": size([p.grad for p in shards if p.grad is not None]),
                "optimizer": size(moments)}

    def step(self, measure: bool) -> StepResult:
        t0 = time.perf_counter()
        tokens, seqs = self._all_reduce(self.counts)
        denominator = max(loss_denominator(LOSS.loss_agg, int(tokens), int(seqs)), 1)
        # the engine averages gradients over dp; each rank backpropagates an unnormalised sum
        scale = self.dp / denominator
        loss_fn = GrpoLossFn(LOSS, self.engine.device)
        for mb in self.micro_batches:
            self.engine.forward_backward(grpo_micro_batch(mb), loss_fn, loss_scale=scale)
        t1 = time.perf_counter()
        memory = self.memory_bytes() if measure else None
        t2 = time.perf_counter()
        stats = self.engine.optimizer_step()
        (loss_sum,) = self._all_reduce([loss_fn.loss_sum])
        t3 = time.perf_counter()
        return (t1 - t0) + (t3 - t2), memory, {"loss": loss_sum / denominator, "grad_norm": stats.grad_norm}

    def info(self) -> dict[str, Any]:
        return {"forward_path": "padded"}


Runner = Callable[[Qwen2Config, list[list[TrainSample]], argparse.Namespace], FsdpRunner | HandWrittenRunner]
RUNNERS: dict[str, Runner] = {
    "fsdp2": FsdpRunner, "hand_written": HandWrittenRunner, "one_process": FsdpRunner,
}


def rank_main(rank: int, world: int, args: argparse.Namespace, engines: list[str]) -> dict[str, Any]:
    """Build ``engines`` on this rank and run their steps interleaved; per engine this rank's step
    seconds, memory at the last timed step, step-0 loss and gradient norm."""
    config = model_config(args)
    micro_batches = rank_micro_batches(global_batch(args), rank, world, args.micro_batch)
    runners = {name: RUNNERS[name](config, micro_batches, args) for name in engines}
    out: dict[str, Any] = {name: {"seconds": [], **runner.info()} for name, runner in runners.items()}
    total = args.warmup + args.steps
    for step in range(total):
        order = engines[step % len(engines) :] + engines[: step % len(engines)]
        for name in order:
            dist.barrier()
            seconds, memory, stats = runners[name].step(measure=step == total - 1)
            if step == 0:
                out[name]["step0"] = stats
            if step >= args.warmup:
                out[name]["seconds"].append(seconds)
            if memory is not None:
                out[name]["memory"] = memory
    return out


# -- worlds of spawned processes --------------------------------------------------------------------------
def _entry(rank: int, world: int, args: argparse.Namespace, engines: list[str], workdir: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
        timeout=timedelta(seconds=args.timeout_s),
    )
    path = Path(workdir, f"result-{rank}.json")
    try:
        path.write_text(json.dumps({"ok": True, "value": rank_main(rank, world, args, engines)}))
    except BaseException:
        path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace, engines: list[str]) -> list[dict[str, Any]]:
    """:func:`rank_main` on ``world`` spawned gloo ranks (FileStore in a temporary directory); the
    results by rank. A rank's failure or an overrun of ``--timeout-s`` raises; every process is
    stopped and joined before this returns."""
    with tempfile.TemporaryDirectory(prefix="streamrl-bench-fsdp-") as workdir:
        context = mp.start_processes(
            _entry, args=(world, args, engines, workdir), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + args.timeout_s
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the world of {world} ranks ({engines}) overran --timeout-s={args.timeout_s}")
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


def combine(by_rank: list[dict[str, Any]], name: str, R: int) -> dict[str, Any]:
    """One engine's figures from its ranks: the slowest rank's time per step, the largest rank's bytes."""
    per_step = [max(r[name]["seconds"][i] for r in by_rank) for i in range(len(by_rank[0][name]["seconds"]))]
    memory = max((r[name]["memory"] for r in by_rank), key=lambda m: sum(m.values()))
    return {
        "R": R,
        "step_ms": spread(s * 1e3 for s in per_step),
        "bytes_per_rank": sum(memory.values()),
        "memory_bytes": memory,
        "step0_loss": by_rank[0][name]["step0"]["loss"],
        "step0_grad_norm": by_rank[0][name]["step0"]["grad_norm"],
        "forward_path": by_rank[0][name]["forward_path"],
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2, help="ranks R of the sharded engines")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (and of the one process)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--quick", action="store_true", help="a tiny model, a small batch, 2 steps: a smoke run")
    parser.add_argument("--no-hand-written", action="store_true", help="skip the hand-written engine's column")
    parser.add_argument("--fsdp-padded", action="store_true",
                        help="FSDP2 on right-padded rows (pack_prompts off), the hand-written engine's forward; by "
                        "default it computes each shared prompt once (the engine's default)")
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
    missing = "skipped by --no-hand-written" if args.no_hand_written else hand_written_missing()
    print(
        f"fsdp engine benchmark: Qwen2 {params / 1e6:.2f}M params ({params:,}) fp32, hidden {args.hidden}, "
        f"{args.layers} layers, vocab {args.vocab}; batch {args.prompts} prompts x {args.group} "
        f"({len(batch)} samples, prompt {args.prompt_len}, {tokens} response tokens), micro-batches of "
        f"{args.micro_batch} per rank; R={R}, {args.threads} thread(s) per rank; {args.warmup} warm-up + "
        f"{args.steps} timed steps",
        flush=True,
    )
    if missing:
        print(f"hand-written engine: {missing}; its column is skipped (its recorded figures are in the docs)")

    started = time.perf_counter()
    sharded = ["fsdp2"] + ([] if missing else ["hand_written"])
    by_rank = run_world(R, args, sharded)
    figures = {name: combine(by_rank, name, R) for name in sharded}
    figures["one_process"] = combine(run_world(1, args, ["one_process"]), "one_process", 1)
    wall = time.perf_counter() - started

    rows = []
    for name in ENGINES:
        f = figures.get(name)
        if f is None:
            rows.append([LABELS[name], R, "skipped", "-", "-", "-", "-", "-", "-"])
            continue
        m = f["memory_bytes"]
        rows.append([
            LABELS[name], f["R"], fmt_spread(f["step_ms"]), f"{m['parameters'] / MIB:.1f}",
            f"{m['gradients'] / MIB:.1f}", f"{m['optimizer'] / MIB:.1f}", f"{f['bytes_per_rank'] / MIB:.1f}",
            f"{f['step0_loss']:.6f} / {f['step0_grad_norm']:.4f}", f["forward_path"],
        ])
    print_table(["engine", "R", "step ms [min, max]", "params MiB", "grads MiB", "optimizer MiB",
                 "total MiB/rank", "step-0 loss / grad norm", "forward"], rows)

    fsdp, one = figures["fsdp2"], figures["one_process"]
    hand = figures.get("hand_written")
    ideal = one["bytes_per_rank"] / R + layer_bytes
    ratio = {
        "step_time_vs_hand_written": fsdp["step_ms"]["median"] / hand["step_ms"]["median"] if hand else None,
        "bytes_per_rank_vs_one_process_share_plus_layer": fsdp["bytes_per_rank"] / ideal,
        "step_time_vs_one_process": fsdp["step_ms"]["median"] / one["step_ms"]["median"],
        "bytes_per_rank_vs_hand_written": fsdp["bytes_per_rank"] / hand["bytes_per_rank"] if hand else None,
    }
    loss_diff = max(abs(f["step0_loss"] - one["step0_loss"]) for f in figures.values())
    target = {"step_time_vs_hand_written_max": 1.0, "bytes_per_rank_vs_one_process_share_plus_layer_max": 1.0}
    met = {
        "step_time": ratio["step_time_vs_hand_written"] <= 1.0 if hand else None,
        "bytes_per_rank": ratio["bytes_per_rank_vs_one_process_share_plus_layer"] <= 1.0,
    }
    if hand:
        print(f"FSDP2 step time / hand-written: {ratio['step_time_vs_hand_written']:.3f} (target <= 1.0); "
              f"bytes per rank / hand-written: {ratio['bytes_per_rank_vs_hand_written']:.3f}")
    else:
        print("FSDP2 step time / hand-written: n/a (hand-written engine skipped)")
    print(f"FSDP2 bytes per rank / (one process / R + one layer {layer_bytes / MIB:.2f} MiB = {ideal / MIB:.1f} MiB): "
          f"{ratio['bytes_per_rank_vs_one_process_share_plus_layer']:.3f} (target <= 1.0); "
          f"FSDP2 R={R} step time / one process: {ratio['step_time_vs_one_process']:.3f}")
    print(f"step-0 losses agree within {loss_diff:.2e}; wall {wall:.0f} s")

    print_json_line(
        "fsdp_engine",
        {"fsdp2": fsdp},
        {"hand_written": hand, "one_process": one},
        ratio,
        target,
        met=met,
        hand_written_skipped=missing,
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
