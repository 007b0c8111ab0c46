"""Rank bodies for the FSDP2 engine tests (importable by the spawned gloo ranks).

Every run trains the same seeded tiny Qwen2 (GQA, q/k/v biases made non-zero so a misplaced TP
bias slice shows) on the same deterministic stream of GRPO micro-batches; only how the samples
are split over ranks changes. A step's 8 samples go round-robin to the dp ranks and then into
micro-batches of 2, except on the "uneven" steps, where the last dp rank packs its samples into
one micro-batch and pads with ``accumulate_padding`` to match the others' count, and on the
"idle" steps, where every odd sample (all of dp rank 1's at dp=2) has advantage 0, so that rank
runs only zero-gradient micro-batches, and on the "lopsided" steps, where dp rank 0 takes every
sample and the others only pad. Loss modes cycle over three aggregations; the lopsided steps use
seq-mean-token-sum-norm, whose constant a rank that only padded must learn from the others.

Tensors come back through safetensors files in the test's directory (no pickle); small values
as JSON through the harness.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, GPT2Config, PreTrainedModel, Qwen2Config

from streamrl.algos.grpo import LossConfig
from streamrl.engines.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine, StateOffloadedError
from streamrl.engines.parallel import ParallelConfigError
from streamrl.engines.samples import NothingAccumulatedError, TrainBatchError, TrainSample

VOCAB = 24
SAMPLES_PER_STEP = 8
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LR = 1e-3


def tiny_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
    )


def build_model(seed: int = 0) -> PreTrainedModel:
    """The same random model in every process (seeded init; biases and norms perturbed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
    return model


def step_samples(step: int) -> tuple[list[TrainSample], LossConfig]:
    """The step's 8 samples (ragged, shared prompts, one empty response) and its loss config."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (2, 5, 3)]
    samples = []
    for i in range(SAMPLES_PER_STEP):
        n = 0 if i == 5 else int(torch.randint(1, 7, (1,), generator=g))
        response = torch.randint(1, VOCAB, (n,), generator=g)
        advantage = float(torch.randn((), generator=g))
        if step % 5 == 3 and i % 2 == 1:
            advantage = 0.0  # "idle" step: dp rank 1 of 2 gets only zero-advantage samples
        noise = torch.randn(3, n, generator=g) * 0.3 - 3.0
        old = noise[1] if step % 2 else None  # recomputed old logprobs on odd steps: TIS weights
        ref = noise[2] if step % 6 == 5 else None  # KL steps: a reference policy's logprobs
        samples.append(TrainSample(prompts[i % 3], response, advantage, rollout_logprobs=noise[0],
                                   old_logprobs=old, ref_logprobs=ref))
    kl_coef = 0.05 if step % 6 == 5 else 0.0
    mode = "seq-mean-token-sum-norm" if step % 7 == 6 else MODES[step % 3]
    return samples, LossConfig(loss_agg=mode, kl_coef=kl_coef, norm_tokens=5)  # type: ignore[arg-type]


def micro_batches(samples: list[TrainSample], dp_rank: int, dp: int, step: int) -> list[list[TrainSample]]:
    mine = samples[dp_rank::dp]
    if step % 7 == 6 and dp > 1:
        mine = samples if dp_rank == 0 else []  # "lopsided" step: the other ranks only pad
    if step % 4 == 1 and dp > 1 and dp_rank == dp - 1:
        return [mine] if mine else []  # "uneven" step: fewer micro-batches here, padded to the others' count
    return [mine[i : i + 2] for i in range(0, len(mine), 2)]


def run_steps(engine: FSDPTrainEngine, first: int, count: int, *, offload_between: bool = False) -> dict[str, Any]:
    """Train steps [first, first + count); per-step global loss, grad norm and all statistics."""
    losses, norms, all_stats = [], [], []
    dp = engine.dp_size
    for step in range(first, first + count):
        samples, config = step_samples(step)
        mbs = micro_batches(samples, engine.dp_rank, dp, step)
        most = max(len(micro_batches(samples, r, dp, step)) for r in range(dp))
        for mb in mbs:
            engine.accumulate(mb, config)
        for _ in range(most - len(mbs)):
            engine.accumulate_padding()
        stats = engine.step()
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        all_stats.append(stats)
        if offload_between:
            engine.offload_state()
            engine.reload_state()
    return {"losses": losses, "grad_norms": norms, "stats": all_stats}


def make_engine(tp: int = 1, model: PreTrainedModel | None = None, **options: Any) -> FSDPTrainEngine:
    return FSDPTrainEngine(build_model() if model is None else model, lr=LR, max_grad_norm=1.0, device="cpu",
                           options=FSDPOptions(tensor_parallel=tp, **options))


def build_gpt2(seed: int = 0) -> PreTrainedModel:
    """An architecture outside the Llama family: learned positions, Conv1D, LayerNorm, tied lm_head."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,  # dropout off: runs must agree
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def save_params(engine: FSDPTrainEngine, path: Path) -> None:
    """Rank 0 writes the full parameters (collective)."""
    state = engine.full_state_dict()
    if dist.get_rank() == 0:
        # clone: tied weights come back as one tensor under two names, which safetensors refuses
        save_file({k: v.clone() for k, v in state.items()}, str(path))


def train_world(rank: int, world: int, tp: int, steps: int, out_dir: str, tag: str) -> dict[str, Any]:
    """Train ``steps`` steps at world / tp data-parallel ranks; rank 0 writes the parameters."""
    engine = make_engine(tp)
    result = run_steps(engine, 0, steps)
    result["memory"] = engine.memory_bytes()
    save_params(engine, Path(out_dir) / f"{tag}.safetensors")
    return result


def fsdp2_world(rank: int, world: int, steps: int, out_dir: str) -> dict[str, Any]:
    """R=2: train, local shards, export, DCP save + the next step; then variants of the first steps."""
    out = Path(out_dir)
    engine = make_engine()
    samples, _ = step_samples(0)
    mine = samples[rank::world]  # each rank scores its own samples: no-grad forward, collective
    logprobs = engine.logprobs([s.prompt_ids for s in mine], [s.response_ids for s in mine], temperature=0.7)
    save_file({f"{i * world + rank}": t for i, t in enumerate(logprobs)}, str(out / f"logprobs-{rank}.safetensors"))
    # Rank 0 scores everything, rank 1 nothing: it joins the forward with empty lists.
    everything = samples if rank == 0 else []
    logprobs = engine.logprobs([s.prompt_ids for s in everything], [s.response_ids for s in everything])
    save_file({str(i): t for i, t in enumerate(logprobs)}, str(out / f"logprobs-all-{rank}.safetensors"))
    result: dict[str, Any] = {"main": run_steps(engine, 0, steps), "memory": engine.memory_bytes()}
    save_params(engine, out / "fsdp2.safetensors")
    save_file({k: v.contiguous() for k, v in engine.local_shards().items()}, str(out / f"shards-{rank}.safetensors"))
    engine.export_pretrained(out / "export")
    save_checkpoint(engine, out / "ckpt")
    result["next"] = run_steps(engine, steps, 1)
    save_params(engine, out / "fsdp2-next.safetensors")
    # Variants over the first steps, each against the main run's losses.
    short = 3
    result["bf16"] = run_steps(make_engine(dtype="bfloat16"), 0, short)
    result["fp16"] = run_steps(make_engine(dtype="float16"), 0, short)
    result["checkpointed_offloaded"] = run_steps(
        make_engine(activation_checkpointing=True), 0, short, offload_between=True
    )
    result["cpu_offload"] = run_steps(make_engine(cpu_offload=True), 0, short)
    return result


def gpt2_world(rank: int, world: int, steps: int, out_dir: str) -> dict[str, Any]:
    """R ranks train the tied-embedding GPT-2; rank 0 writes the parameters, then the export."""
    engine = make_engine(model=build_gpt2())
    result = run_steps(engine, 0, steps)
    save_params(engine, Path(out_dir) / "gpt2.safetensors")
    engine.export_pretrained(Path(out_dir) / "gpt2-export", dtype=torch.bfloat16)
    return result


def resume_world(rank: int, world: int, tp: int, steps: int, out_dir: str, tag: str) -> dict[str, Any]:
    """Load the R=2 checkpoint at this world's size; its parameters, then one more step."""
    out = Path(out_dir)
    engine = make_engine(tp)
    load_checkpoint(engine, out / "ckpt")
    save_params(engine, out / f"{tag}-loaded.safetensors")
    result = {"steps_after_load": engine.steps, "next": run_steps(engine, steps, 1)}
    save_params(engine, out / f"{tag}-next.safetensors")
    return result


def refusals_world(rank: int, world: int, out_dir: str) -> dict[str, str]:
    """The errors a caller can meet, each message returned for the test to check."""
    seen: dict[str, str] = {}
    wrong_names = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replica", "shard"))
    try:
        FSDPTrainEngine(build_model(), lr=LR, device="cpu", mesh=wrong_names)
    except ParallelConfigError as exc:
        seen["mesh_names"] = str(exc)
    try:
        make_engine(tp=2)
    except ParallelConfigError as exc:
        seen["tp_world"] = str(exc)
    engine = make_engine()
    samples, config = step_samples(0)
    try:
        engine.step()
    except NothingAccumulatedError as exc:
        seen["step_first"] = str(exc)
    try:
        engine.accumulate([], config)
    except TrainBatchError as exc:
        seen["empty"] = str(exc)
    bad = TrainSample(samples[0].prompt_ids.float(), samples[0].response_ids, 1.0)
    try:
        engine.accumulate([bad], config)
    except TrainBatchError as exc:
        seen["float_ids"] = str(exc)
    engine.offload_state()
    try:
        engine.accumulate(samples[:2], config)
    except StateOffloadedError as exc:
        seen["offloaded"] = str(exc)
    try:
        engine.offload_state()
    except StateOffloadedError as exc:
        seen["offload_twice"] = str(exc)
    engine.reload_state()
    try:
        load_checkpoint(engine, Path(out_dir) / "nowhere")
    except CheckpointError as exc:
        seen["no_checkpoint"] = str(exc)
    # A step mixing loss modes is refused before any compute.
    engine.accumulate(samples[:2], LossConfig(loss_agg="token-mean"))
    try:
        engine.accumulate(samples[2:4], LossConfig(loss_agg="seq-mean-token-sum"))
    except ValueError as exc:
        seen["mixed_modes"] = str(exc)
    engine.zero_grad()
    # Explicit global counts: twice the tokens halves the normalised gradient (norm before clipping).
    token_mean = LossConfig(loss_agg="token-mean")
    engine.set_lr(1e-12)  # the weights stay put between the two steps
    norms = []
    for scale in (1, 2):
        engine.accumulate(samples[:4], token_mean)
        tokens = engine.pending()["tokens"]
        norms.append(engine.step(global_tokens=scale * tokens, global_sequences=4)["grad_norm"])
    seen["norm_ratio"] = f"{norms[0] / norms[1]:.4f}"
    logprobs = engine.logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    seen["logprob_lengths"] = str([t.numel() for t in logprobs])
    return seen
