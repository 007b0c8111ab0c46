"""The FSDP2 / DTensor train engine on real gloo worlds equals one process, and survives DCP resharding.

One spawned world per layout (start-up dominates on this 2-core machine), every check of that
layout inside it; see ``fsdp_workers``. Reference: the same engine at R=1, and an independent
oracle in this process (``plain_reference.PlainReference``: the plain HF module, one forward per
sample, torch's clip_grad_norm_ and AdamW).

Tolerances (float32, CPU; seen here): a step's loss is a sum over ranks of float32 partial sums,
so R=2 and R=1 differ by rounding only (seen 2.9e-7 over 20 steps; FSDP R=1 vs the oracle
5e-8). After 20 AdamW steps at lr 1e-3 the parameters differ by 6.1e-6 (FSDP R=2), 1.7e-6
(the oracle: per-sample forwards, per-parameter AdamW), 3.9e-6 / 2.9e-6 (TP=2 / dp2 x tp2),
far below the 1.6e-2 that training moved them. Rounding differences grow through Adam: a
gradient component near zero is divided by its own small sqrt(v), so its update's last bits
follow the summation order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from streamrl.engines.fsdp import FSDPOptions
from streamrl.engines.parallel import ParallelConfigError, build_mesh, decoder_layers, tensor_parallel_plan
from tests.engines.fsdp_workers import (
    LR,
    build_gpt2,
    build_model,
    fsdp2_world,
    gpt2_world,
    micro_batches,
    refusals_world,
    resume_world,
    step_samples,
    train_world,
)
from tests.engines.plain_reference import PlainReference
from tests.reshard.reshard_harness import run_world

STEPS = 20
LOSS_ATOL = 1e-6
FSDP_PARAM_ATOL = 1e-5
TP_PARAM_ATOL = 2e-5
# GPT-2's fused c_attn bias and c_proj weight hold components whose gradient is near zero; Adam
# divides them by their own tiny sqrt(v), so the last bits of the summation order show up in the
# parameters. After 8 steps the worst difference was 3.2e-6 on one machine and 1.47e-5 on the CI
# machine (a different CPU, same code), against the ~7e-3 that training moved every tensor: 5e-5
# is 0.7% of that movement. The losses and gradient norms are held to 1e-6 / 1e-5 relative.
GPT2_PARAM_ATOL = 5e-5


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def fsdp2(out_dir: Path) -> dict[str, Any]:
    """The R=2 world: 20 steps, shards, export, checkpoint + next step, precision/option variants."""
    by_rank = run_world(fsdp2_world, 2, STEPS, str(out_dir), timeout_s=150.0)
    return {**by_rank[0], "memory_by_rank": [r["memory"] for r in by_rank]}


@pytest.fixture(scope="module")
def one_rank(out_dir: Path) -> dict[str, Any]:
    return run_world(train_world, 1, 1, STEPS, str(out_dir), "r1", timeout_s=90.0)[0]


@pytest.fixture(scope="module")
def torch_engine() -> Iterator[tuple[list[float], dict[str, torch.Tensor]]]:
    """The plain single-process oracle on the same samples (one rank's micro-batches)."""
    engine = PlainReference(build_model(), lr=LR, max_grad_norm=1.0)
    losses = []
    for step in range(STEPS):
        samples, config = step_samples(step)
        for mb in micro_batches(samples, 0, 1, step):
            engine.accumulate(mb, config)
        losses.append(engine.step()["loss"])
    yield losses, engine.state_dict()


def _params(out_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / f"{tag}.safetensors"))


def _assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"{what}: parameters differ by {worst:.3g} > {atol}"


def _assert_losses_close(a: list[float], b: list[float], atol: float, what: str) -> None:
    assert len(a) == len(b), what
    worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
    assert worst <= atol, f"{what}: losses differ by {worst:.3g} > {atol}: {a} vs {b}"


def test_fsdp_two_ranks_equal_one_rank(fsdp2: dict[str, Any], one_rank: dict[str, Any], out_dir: Path) -> None:
    _assert_losses_close(fsdp2["main"]["losses"], one_rank["losses"], LOSS_ATOL, "R=2 vs R=1")
    torch.testing.assert_close(fsdp2["main"]["grad_norms"], one_rank["grad_norms"], rtol=1e-5, atol=1e-6)
    # Every statistic is the global one (micro-batch counts differ by construction: padding).
    for step, (two, one) in enumerate(zip(fsdp2["main"]["stats"], one_rank["stats"], strict=True)):
        assert two.keys() == one.keys(), step
        for key in two.keys() - {"micro_batches"}:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), (step, key)
    assert any("kl" in s for s in one_rank["stats"]) and any("is_weight" in s for s in one_rank["stats"])
    assert any(s["skipped_sequences"] for s in one_rank["stats"])
    _assert_params_close(_params(out_dir, "fsdp2"), _params(out_dir, "r1"), FSDP_PARAM_ATOL, "R=2 vs R=1")
    # The run really trained: parameters moved far more than the tolerance.
    start = build_model().state_dict()
    moved = max((_params(out_dir, "r1")[k] - v).abs().max().item() for k, v in start.items())
    assert moved > 100 * FSDP_PARAM_ATOL


def test_logprobs_at_two_ranks_equal_the_plain_reference(fsdp2: dict[str, Any], out_dir: Path) -> None:
    samples, _ = step_samples(0)
    reference = PlainReference(build_model(), lr=LR).logprobs(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], temperature=0.7
    )
    got = {**load_file(str(out_dir / "logprobs-0.safetensors")), **load_file(str(out_dir / "logprobs-1.safetensors"))}
    assert sorted(got, key=int) == [str(i) for i in range(len(samples))]
    for i, expected in enumerate(reference):
        torch.testing.assert_close(got[str(i)], expected, atol=1e-6, rtol=1e-6)
    reference = PlainReference(build_model(), lr=LR).logprobs(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    )
    alone = load_file(str(out_dir / "logprobs-all-0.safetensors"))
    assert load_file(str(out_dir / "logprobs-all-1.safetensors")) == {}
    for i, expected in enumerate(reference):
        torch.testing.assert_close(alone[str(i)], expected, atol=1e-6, rtol=1e-6)


def test_each_rank_holds_half_of_the_training_state(fsdp2: dict[str, Any], one_rank: dict[str, Any]) -> None:
    """Parameters and AdamW moments are sharded (unpadded pieces: the two halves add up exactly)."""
    whole = one_rank["memory"]
    assert whole["parameters"] > 0 and whole["optimizer"] == 2 * whole["parameters"]  # exp_avg, exp_avg_sq
    # FSDP2 splits dim 0 as ceil(rows / 2) + the rest: rank 0 holds at most one row more per parameter.
    one_row = sum(p[0].numel() * p.element_size() for p in build_model().parameters())
    for key, copies in (("parameters", 1), ("optimizer", 2)):
        per_rank = [fsdp2["memory_by_rank"][r][key] for r in range(2)]
        assert sum(per_rank) == whole[key], key
        assert max(per_rank) <= whole[key] / 2 + copies * one_row, key
    assert fsdp2["memory"]["gradients"] == 0  # step() drops them (set_to_none)


def test_fsdp_equals_the_plain_single_process_reference(
    one_rank: dict[str, Any], torch_engine: tuple[list[float], dict[str, torch.Tensor]], out_dir: Path
) -> None:
    losses, state = torch_engine
    _assert_losses_close(one_rank["losses"], losses, LOSS_ATOL, "FSDP R=1 vs the plain reference")
    _assert_params_close(_params(out_dir, "r1"), state, FSDP_PARAM_ATOL, "FSDP R=1 vs the plain reference")


@pytest.mark.slow  # the slow tier: the 2x2 test below runs TP=2 inside FSDP
def test_tensor_parallel_two_equals_one_rank(one_rank: dict[str, Any], out_dir: Path) -> None:
    tp2 = run_world(train_world, 2, 2, STEPS, str(out_dir), "tp2", timeout_s=120.0)[0]
    _assert_losses_close(tp2["losses"], one_rank["losses"], LOSS_ATOL, "TP=2 vs R=1")
    _assert_params_close(_params(out_dir, "tp2"), _params(out_dir, "r1"), TP_PARAM_ATOL, "TP=2 vs R=1")


def test_fsdp_by_tensor_parallel_2x2_equals_one_rank(one_rank: dict[str, Any], out_dir: Path) -> None:
    dp2tp2 = run_world(train_world, 4, 2, STEPS, str(out_dir), "dp2tp2", timeout_s=150.0)[0]
    _assert_losses_close(dp2tp2["losses"], one_rank["losses"], LOSS_ATOL, "dp2 x tp2 vs R=1")
    _assert_params_close(_params(out_dir, "dp2tp2"), _params(out_dir, "r1"), TP_PARAM_ATOL, "dp2 x tp2 vs R=1")


def test_local_shards_are_dim0_pieces_of_the_full_parameters(fsdp2: dict[str, Any], out_dir: Path) -> None:
    full = _params(out_dir, "fsdp2")
    shards = [load_file(str(out_dir / f"shards-{r}.safetensors")) for r in range(2)]
    assert shards[0].keys() == full.keys()
    for name, tensor in full.items():
        assert shards[0][name].shape[0] == (tensor.shape[0] + 1) // 2, name  # FSDP2's ceil split
        assert torch.equal(torch.cat([shards[0][name], shards[1][name]]), tensor), name


def test_export_pretrained_loads_in_transformers(fsdp2: dict[str, Any], out_dir: Path) -> None:
    export = out_dir / "export"
    assert list(export.glob("*.safetensors")), "no safetensors weights written"
    loaded = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    full = _params(out_dir, "fsdp2")
    state = loaded.state_dict()
    for name, tensor in full.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize(("world", "tp"), [(1, 1), (4, 1), (4, 2)])
def test_dcp_checkpoint_saved_at_two_ranks_resumes_at_another_layout(
    fsdp2: dict[str, Any], out_dir: Path, world: int, tp: int
) -> None:
    tag = f"resume-{world}x{tp}"
    resumed = run_world(resume_world, world, tp, STEPS, str(out_dir), tag, timeout_s=150.0)[0]
    assert resumed["steps_after_load"] == STEPS
    for name, tensor in _params(out_dir, "fsdp2").items():  # the loaded weights are the saved bits
        assert torch.equal(_params(out_dir, f"{tag}-loaded")[name], tensor), name
    # The next step: same loss, same update (AdamW moments and step count restored too).
    _assert_losses_close(resumed["next"]["losses"], fsdp2["next"]["losses"], LOSS_ATOL, tag)
    atol = TP_PARAM_ATOL if tp > 1 else 1e-6
    _assert_params_close(_params(out_dir, f"{tag}-next"), _params(out_dir, "fsdp2-next"), atol, tag)


def test_reduced_precision_runs_close_to_float32(fsdp2: dict[str, Any]) -> None:
    fp32 = fsdp2["main"]["losses"][:3]
    for dtype in ("bf16", "fp16"):
        losses = fsdp2[dtype]["losses"]
        assert all(torch.isfinite(torch.tensor(losses))), dtype
        # bfloat16 keeps 8 mantissa bits: the loss moved by 2.3e-4 here (fp16: 3e-6) of ~1.
        _assert_losses_close(losses, fp32, 0.01 * max(abs(x) for x in fp32), dtype)
        assert losses != fp32, f"{dtype} ran in float32"


def test_activation_checkpointing_offload_and_cpu_offload_keep_the_result(fsdp2: dict[str, Any]) -> None:
    fp32 = fsdp2["main"]["losses"][:3]
    _assert_losses_close(fsdp2["checkpointed_offloaded"]["losses"], fp32, 1e-7, "activation checkpointing")
    _assert_losses_close(fsdp2["cpu_offload"]["losses"], fp32, 1e-7, "CPUOffloadPolicy")


def test_an_architecture_outside_the_llama_family_trains(out_dir: Path) -> None:
    """GPT-2 (Conv1D, LayerNorm, learned positions, tied lm_head) through its own HF forward."""
    steps = 8
    fsdp = run_world(gpt2_world, 2, steps, str(out_dir), timeout_s=120.0)[0]
    engine = PlainReference(build_gpt2(), lr=LR, max_grad_norm=1.0)
    losses, grad_norms = [], []
    for step in range(steps):
        samples, config = step_samples(step)
        for mb in micro_batches(samples, 0, 1, step):
            engine.accumulate(mb, config)
        stats = engine.step()
        losses.append(stats["loss"])
        grad_norms.append(stats["grad_norm"])
    _assert_losses_close(fsdp["losses"], losses, LOSS_ATOL, "GPT-2 R=2 vs the plain reference")
    torch.testing.assert_close(fsdp["grad_norms"], grad_norms, rtol=1e-5, atol=1e-6)
    params = _params(out_dir, "gpt2")
    _assert_params_close(params, engine.state_dict(), GPT2_PARAM_ATOL, "GPT-2 R=2 vs the plain reference")
    exported = AutoModelForCausalLM.from_pretrained(out_dir / "gpt2-export", local_files_only=True, dtype="auto")
    assert exported.lm_head.weight is exported.transformer.wte.weight  # still tied after the export
    for name, tensor in exported.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, params[name].to(torch.bfloat16)), name


def test_refusals_name_the_problem(out_dir: Path) -> None:
    seen = run_world(refusals_world, 1, str(out_dir), timeout_s=90.0)[0]
    assert "mesh_dim_names ('dp', 'tp')" in seen["mesh_names"] and "('replica', 'shard')" in seen["mesh_names"]
    assert "tensor_parallel (2) must be >= 1 and divide the world size (1)" in seen["tp_world"]
    assert "before any accumulate" in seen["step_first"] and "on all 1 dp ranks" in seen["step_first"]
    assert "accumulate_padding" in seen["empty"]
    assert "prompt_ids must be a 1-D int64 tensor" in seen["float_ids"]
    assert "reload_state()" in seen["offloaded"] and "already offloaded" in seen["offload_twice"]
    assert "nowhere" in seen["no_checkpoint"] and ".metadata" in seen["no_checkpoint"]
    assert "loss_agg changed" in seen["mixed_modes"]
    assert seen["norm_ratio"] == "2.0000"
    lengths = [s.response_ids.numel() for s in step_samples(0)[0]]
    assert seen["logprob_lengths"] == str(lengths)


def test_configuration_errors_need_no_world() -> None:
    with pytest.raises(ParallelConfigError, match="init_process_group"):
        build_mesh("cpu", 1)
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1"):
        FSDPOptions(tensor_parallel=0)
    model = build_model()
    layer = decoder_layers(model)[0]
    assert type(layer).__name__ == "Qwen2DecoderLayer" and len(decoder_layers(model)) == 2
    with pytest.raises(ParallelConfigError, match="k_proj has 2 heads, which tensor_parallel=4"):
        tensor_parallel_plan(layer, 4)
    with pytest.raises(ParallelConfigError, match="do not split into tensor_parallel=3"):
        tensor_parallel_plan(layer, 3)
    with pytest.raises(ParallelConfigError, match="_no_split_modules"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
