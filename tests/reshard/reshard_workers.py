"""Rank bodies for the reshard tests (importable by spawned processes) and an independent oracle.

The train side is the FSDP2 engine (:class:`streamrl.engines.fsdp.FSDPTrainEngine`: ``fully_shard``
per decoder layer and root, optionally x DTensor TP), trained with the GRPO loss on
:class:`~streamrl.engines.samples.TrainSample` lists; the resharder reads its ``to_local()`` shards
(FSDP2's unpadded dim-0 shards) through the spec of its placements
(:func:`streamrl.reshard.fsdp_layout.spec_for_placements`), as the pipeline does.

The oracle (:func:`expected_slice`) writes the vLLM fused per-rank layout with plain torch
slicing and ``torch.cat`` from the full weights, without any of streamrl.reshard's rectangle
machinery, so a test comparing the two is a real cross-check. The full weights it starts from
are ``DTensor.full_tensor()`` of every parameter (:func:`full_tensors`), a route that shares
nothing with the resharder's own gather.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config

from streamrl.algos.grpo import LossConfig
from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine, StateOffloadedError
from streamrl.engines.parallel import build_mesh, local
from streamrl.engines.samples import TrainSample
from streamrl.reshard import (
    ColocatedPolicy,
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    ReshardReport,
    Topology,
    TrainLayout,
    WeightReceiver,
    WeightSender,
    build_rank_groups,
    rope_theta,
    tensor_parallel_logits,
)
from streamrl.reshard.fsdp_layout import spec_for_placements
from streamrl.reshard.shards import local_shape
from tests.reshard.reshard_harness import build_model, tiny_config

SEQ = 8
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.01, 0.5
SAMPLES_PER_STEP = 8
LOSS = LossConfig()  # token-mean; no behaviour logprobs: on-policy, ratio 1
ITEMSIZE = 4  # float32 shards and inference weights


def expected_slice(
    full: dict[str, torch.Tensor], config: Qwen2Config, T: int, t: int
) -> dict[str, torch.Tensor]:
    """Inference rank t of T in the fused layout, from the full weights, written out by hand."""
    H, nh, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    d = H // nh
    V, Im = config.vocab_size, config.intermediate_size
    qh = nh // T
    if nkv >= T:
        kh, kv0 = nkv // T, t * (nkv // T)
    else:
        kh, kv0 = 1, t // (T // nkv)
    It = Im // T
    rows = -(-V // T)

    def vocab_block(weight: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([weight, weight.new_zeros(rows * T - V, H)])
        return padded[t * rows : (t + 1) * rows].clone()

    out = {"model.embed_tokens.weight": vocab_block(full["model.embed_tokens.weight"])}
    lm_head = full.get("lm_head.weight", full["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        for kind in ("weight", "bias"):
            if f"{a}q_proj.{kind}" not in full:  # Llama without attention bias
                continue
            q, k, v = (full[f"{a}{proj}.{kind}"] for proj in ("q_proj", "k_proj", "v_proj"))
            out[f"{a}qkv_proj.{kind}"] = torch.cat(
                [q[t * qh * d : (t + 1) * qh * d], k[kv0 * d : (kv0 + kh) * d], v[kv0 * d : (kv0 + kh) * d]]
            )
        out[a + "o_proj.weight"] = full[a + "o_proj.weight"][:, t * qh * d : (t + 1) * qh * d].clone()
        gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [gate[t * It : (t + 1) * It], up[t * It : (t + 1) * It]]
        )
        out[p + "mlp.down_proj.weight"] = full[p + "mlp.down_proj.weight"][:, t * It : (t + 1) * It].clone()
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = full[p + norm].clone()
    out["model.norm.weight"] = full["model.norm.weight"].clone()
    out["lm_head.weight"] = vocab_block(lm_head)
    return out


# -- training: GRPO samples, the FSDP2 engine, an unsharded reference ------------------------------
def grpo_steps(config: Qwen2Config, steps: int, seed: int = 1) -> list[list[TrainSample]]:
    """``steps`` optimizer steps of 8 ragged GRPO samples each (random prompts, responses, advantages)."""
    g = torch.Generator().manual_seed(seed)
    V = config.vocab_size

    def ids(lo: int, hi: int) -> torch.Tensor:
        return torch.randint(0, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g)

    return [
        [TrainSample(ids(2, 6), ids(1, 7), float(torch.randn((), generator=g))) for _ in range(SAMPLES_PER_STEP)]
        for _ in range(steps)
    ]


def make_engine(config: Qwen2Config, mesh: DeviceMesh, tp: int = 1, *,
                wrap_single_rank: bool = False) -> FSDPTrainEngine:
    """The seeded test model, sharded with FSDP2 (x TP when the mesh is (dp, tp)) over ``mesh``
    (a mesh of one: unwrapped unless ``wrap_single_rank``, as the engine does)."""
    return FSDPTrainEngine(
        build_model(config), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM, device="cpu",
        mesh=mesh, options=FSDPOptions(tensor_parallel=tp, wrap_single_rank=wrap_single_rank),
    )


def fsdp2_spec(engine: FSDPTrainEngine) -> tuple[ModelShardingSpec, TrainLayout]:
    """The spec whose train TP dims follow the engine's DTensor placements, and its train layout."""
    return spec_for_placements(ModelShardingSpec.from_model(engine.model), engine.model)


def train_step(engine: FSDPTrainEngine, samples: list[TrainSample]) -> float:
    """One optimizer step (collective): dp rank d takes samples d, d + dp, ... in two micro-batches
    (the tp ranks of a dp rank pass the same ones). Returns the step's global loss."""
    mine = samples[engine.dp_rank :: engine.dp_size]
    half = len(mine) // 2
    for micro_batch in (mine[:half], mine[half:]):
        engine.accumulate(micro_batch, LOSS)
    return engine.step()["loss"]


def reference_steps(config: Qwen2Config, steps: list[list[TrainSample]]) -> tuple[nn.Module, list[float]]:
    """The same steps in one process, written out: per-sample HF forward, GRPO loss at ratio 1
    (-advantage per response token, token-mean over the step), clip_grad_norm_, torch AdamW."""
    model = build_model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses = []
    for samples in steps:
        tokens = sum(s.response_ids.numel() for s in samples)
        total = 0.0
        for s in samples:
            ids = torch.cat([s.prompt_ids, s.response_ids])[None]
            logits = model(input_ids=ids).logits[0, s.prompt_ids.numel() - 1 : -1]
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, s.response_ids[:, None]).squeeze(1)
            loss = -(s.advantage * torch.exp(logp - logp.detach())).sum() / tokens
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, losses


def full_tensors(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    """``{name: p.full_tensor()}`` of every parameter (collective over each parameter's mesh); the
    parameters themselves where the engine trains its one-rank module unwrapped."""
    full = {}
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if not engine.wrapped:
                assert not isinstance(p, DTensor), f"{name} is a DTensor in an unwrapped engine"
                full[name] = p.detach().clone()
                continue
            assert isinstance(p, DTensor), f"{name} is not an FSDP2 DTensor"
            full[name] = p.full_tensor().contiguous()
    return full


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _logits(config: Qwen2Config, full: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The unsharded model's logits with the weights ``full``."""
    checker = build_model(config)
    checker.load_state_dict(full)
    with torch.no_grad():
        return checker(input_ids=ids).logits


def _check_inference(
    spec: ModelShardingSpec,
    config: Qwen2Config,
    groups: Any,
    weights: dict[str, torch.Tensor],
    full: dict[str, torch.Tensor],
    ids: torch.Tensor,
) -> dict[str, Any]:
    """Slices vs the oracle of ``full`` (bitwise) and TP logits vs the full model's."""
    T, t = groups.topology.inference.tensor_parallel, groups.inference_rank
    expected = expected_slice(full, config, T, t)
    result: dict[str, Any] = {
        "inference_rank": t,
        "names_diff": sorted(set(weights) ^ set(expected)),
        "mismatched": [n for n in expected if n in weights and not torch.equal(weights[n], expected[n])],
    }
    logits = tensor_parallel_logits(
        weights,
        spec,
        ids,
        rope_theta=rope_theta(config),
        rms_norm_eps=config.rms_norm_eps,
        inference_rank=t,
        tensor_parallel=T,
        group=groups.inference_group,
    )
    result["logits_max_diff"] = float((logits - _logits(config, full, ids)).abs().max())
    result["logits_shape"] = list(logits.shape)
    return result


def vocab_padding_bytes(config: Qwen2Config, T: int, t: int) -> int:
    """Bytes of inference rank t's vocab-padding rows (embed_tokens and lm_head): never written."""
    V, rows = config.vocab_size, -(-config.vocab_size // T)
    pad = max(0, (t + 1) * rows - max(V, t * rows))
    return 2 * pad * config.hidden_size * ITEMSIZE


# -- colocated: FSDP2 training, reshard slices, TP logits, accounting, awaitables, swap ------------
def colocated_matrix(
    config: Qwen2Config, mesh: DeviceMesh, tp_train: int, inference_tps: list[int], bucket_bytes: int
) -> dict[str, Any]:
    rank = dist.get_rank()
    engine = make_engine(config, mesh, tp_train)
    spec, layout = fsdp2_spec(engine)
    groups_by_t = {T: build_rank_groups(Topology.colocated(layout, T)) for T in inference_tps}

    steps = grpo_steps(config, steps=3)
    losses = [train_step(engine, samples) for samples in steps]
    full = full_tensors(engine)
    state = engine.full_state_dict(all_ranks=True)
    initial = build_model(config).state_dict()
    shards = engine.local_shards()
    train: dict[str, Any] = {
        "layout": [layout.world_size, layout.tensor_parallel],
        "tp_dims": {p.name: p.train_tp_dim for p in spec.params},
        "losses": losses,
        "moved_from_init": _max_diff(full, {k: initial[k] for k in full}),
        "state_dict_equals_full_tensor": set(state) == set(full)
        and all(torch.equal(state[n], full[n]) for n in full),
        # FSDP2's to_local() shards that are shorter than the padded layout shape (uneven dim 0)
        "unpadded": sorted(p.name for p in spec.params if tuple(shards[p.name].shape) != local_shape(p, layout)),
    }
    if rank == 0:  # the unsharded reference, once
        reference, ref_losses = reference_steps(config, steps)
        train["ref_losses"] = ref_losses
        train["max_param_diff"] = _max_diff(full, {k: v.detach() for k, v in reference.named_parameters()})
    result: dict[str, Any] = {"train": train, "by_t": {}}

    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    for T in inference_tps:
        groups = groups_by_t[T]
        resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=bucket_bytes))
        out = {n: torch.zeros(s) for n, s in resharder.inference_shapes().items()}
        report = resharder.reshard_local(engine.local_shards(), out, version=1)
        check = _check_inference(spec, config, groups, out, full, ids)
        check.update(
            buckets=len(report.buckets),
            peak_extra_bytes=report.peak_extra_bytes,
            largest_bucket_bytes=report.largest_bucket_bytes,
            bucket_bytes=bucket_bytes,
            bytes_moved=report.bytes_moved,
            sliced_bytes=report.sliced_bytes,
            inference_bytes=sum(v.numel() * ITEMSIZE for v in out.values()),
            padding_bytes=vocab_padding_bytes(config, T, check["inference_rank"]),
            # one rank's slot of the gathered buffers: its shards at the layout's padded shapes
            slot_bytes=sum(b.local_numel for b in resharder.buckets) * ITEMSIZE,
            bucket_times=[b.gather_s + b.slice_s for b in report.buckets],
        )
        # the naive baseline on the same shards: one bucket, the whole model gathered at once
        naive = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=None))
        naive_out = {n: torch.zeros(s) for n, s in naive.inference_shapes().items()}
        naive_report = naive.reshard_local(engine.local_shards(), naive_out, version=1)
        check["naive_equal"] = all(torch.equal(naive_out[n], out[n]) for n in out)
        check["naive_peak_extra_bytes"] = naive_report.peak_extra_bytes
        if T == 1:  # the stream a colocated vLLM engine loads: whole HF parameters, bucket by bucket
            stream_report = ReshardReport(1, "colocated", bucket_bytes)
            streamed = dict(resharder.reshard_local_stream(engine.local_shards(), stream_report))
            check["stream_equal"] = set(streamed) == set(full) and all(torch.equal(streamed[n], full[n]) for n in full)
            check["stream_buckets"] = len(stream_report.buckets)
            check["stream_peak_extra_bytes"] = stream_report.peak_extra_bytes
            check["stream_largest_bucket_bytes"] = stream_report.largest_bucket_bytes
        result["by_t"][str(T)] = check
    result["awaitable"] = _awaitable_check(engine, spec, groups_by_t[inference_tps[-1]])
    return result


def _awaitable_check(engine: FSDPTrainEngine, spec: ModelShardingSpec, groups: Any) -> dict[str, Any]:
    """to_inference/to_training are awaitables: other tasks run meanwhile; generation awaits the version."""
    policy = ColocatedPolicy(engine, Resharder(spec, groups, config=ReshardConfig(bucket_bytes=4096)))
    record: dict[str, Any] = {"ticks": 0, "order": []}

    async def main() -> None:
        done = anyio.Event()

        async def ticker() -> None:
            while not done.is_set():
                record["ticks"] += 1
                await anyio.sleep(0)

        async def generator() -> None:
            version = await policy.weights.wait_version(5)
            record["order"].append(f"generator saw {version}")
            async with policy.weights.use(5) as weights:
                record["lease_version"] = policy.weights.version
                record["state_on_host_in_inference"] = engine.state_on_host
                record["qkv_nonzero"] = bool(
                    weights["model.layers.0.self_attn.qkv_proj.weight"].abs().sum() > 0
                )

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            tg.start_soon(generator)
            await anyio.sleep(0.05)
            record["order"].append("to_inference")
            ticks_before = record["ticks"]
            report = await policy.to_inference(5)
            record["ticks_during"] = record["ticks"] - ticks_before
            record["phase_after_to_inference"] = policy.phase
            assert policy.last_swap is not None
            record["swap_out"] = [policy.last_swap.direction, policy.last_swap.bytes]
            record["reshard_buckets"] = len(report.buckets)
            await anyio.sleep(0.05)
            back = await policy.to_training()
            record["swap_in"] = [back.direction, back.bytes] if back is not None else None
            record["phase_after_to_training"] = policy.phase
            record["released_version"] = policy.weights.version
            try:
                await policy.to_training()
            except Exception as exc:  # PhaseError: transitions are checked
                record["double_to_training"] = type(exc).__name__
            done.set()

    anyio.run(main)
    record["engine_on_device"] = not engine.state_on_host
    return record


# -- swap: training with a reshard + offload/reload between steps equals training without ---------
def _snapshot(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    """Clones of this rank's training state: parameter shards, gradients, AdamW state."""
    snap = {}
    for name, p in engine.model.named_parameters():
        snap[f"{name}/data"] = local(p.data).clone()
        if p.grad is not None:
            snap[f"{name}/grad"] = local(p.grad).clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                snap[f"{name}/{key}"] = local(value).clone()
    return snap


def _shards_equal(a: FSDPTrainEngine, b: FSDPTrainEngine) -> bool:
    sa, sb = a.local_shards(), b.local_shards()
    return sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def swap_round_trip(config: Qwen2Config, mesh: DeviceMesh, tp_train: int) -> dict[str, Any]:
    plain = make_engine(config, mesh, tp_train)
    swapped = make_engine(config, mesh, tp_train)
    spec, layout = fsdp2_spec(swapped)
    groups = build_rank_groups(Topology.colocated(layout, layout.world_size))
    policy = ColocatedPolicy(swapped, Resharder(spec, groups, config=ReshardConfig(bucket_bytes=8192)))
    steps = grpo_steps(config, steps=4, seed=3)
    plain_losses, swapped_losses, refused = [], [], []
    phases: list[list[Any]] = []

    async def run_swapped() -> None:
        for version, samples in enumerate(steps, start=1):
            swapped_losses.append(train_step(swapped, samples))
            await policy.to_inference(version)
            out = policy.last_swap
            assert out is not None
            phases.append([policy.phase, swapped.state_on_host, out.direction, out.bytes])
            try:
                swapped.accumulate(samples[:1], LOSS)
            except StateOffloadedError:
                refused.append(version)
            async with policy.weights.use(version):
                pass
            back = await policy.to_training()
            assert back is not None
            phases.append([policy.phase, swapped.state_on_host, back.direction, back.bytes])

    for samples in steps:
        plain_losses.append(train_step(plain, samples))
    anyio.run(run_swapped)
    params_equal = _shards_equal(plain, swapped)

    # a round trip with gradients accumulated mid-step and AdamW moments present
    mine = steps[0][swapped.dp_rank :: swapped.dp_size]
    swapped.accumulate(mine, LOSS)
    before = _snapshot(swapped)
    out_report = swapped.offload_state()
    on_host = swapped.state_on_host
    try:
        swapped.local_shards()
        read_refused = False
    except StateOffloadedError:
        read_refused = True
    in_report = swapped.reload_state()
    after = _snapshot(swapped)
    plain.accumulate(mine, LOSS)  # the same step finished on both: still identical
    final_losses = [plain.step()["loss"], swapped.step()["loss"]]
    return {
        "plain_losses": plain_losses,
        "swapped_losses": swapped_losses,
        "params_equal": params_equal,
        "refused_versions": refused,
        "phases": phases,
        "snapshot_kinds": sorted({k.rsplit("/", 1)[1] for k in before}),
        "round_trip_equal": before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
        "on_host": on_host,
        "read_refused": read_refused,
        "swap": [out_report.direction, out_report.bytes, in_report.direction, in_report.bytes],
        "final_losses": final_losses,
        "params_equal_after_round_trip": _shards_equal(plain, swapped),
    }


def colocated_world(
    rank: int, world: int, tp_train: int, inference_tps: list[int], bucket_bytes: int, vocab: int
) -> dict[str, Any]:
    """One spawned world, several checks (process start-up dominates the cost of these tests).

    The whole world is the train group: the FSDP2 mesh is ``build_mesh("cpu", tp_train)``, shared
    by every engine of the world.
    """
    config = tiny_config(vocab_size=vocab)
    mesh = build_mesh("cpu", tp_train)
    return {
        "matrix": colocated_matrix(config, mesh, tp_train, inference_tps, bucket_bytes),
        "swap": swap_round_trip(config, mesh, tp_train),
    }


# -- disaggregated: train ranks send, generation workers receive under a reader lease -------------
async def _train_side(
    engine: FSDPTrainEngine, sender: WeightSender, samples: list[TrainSample], full_path: Path
) -> dict[str, Any]:
    record: dict[str, Any] = {"role": "train"}
    report = await sender.send(1)
    record["v1"] = report.summary() | {"staging": max(b.staging_bytes for b in report.buckets)}
    await anyio.to_thread.run_sync(dist.barrier)  # generation has checked v1 and holds a lease on it
    record["loss"] = train_step(engine, samples)
    full = full_tensors(engine)  # collective over the train ranks
    if dist.get_rank() == 0:
        save_file(full, str(full_path))  # the generation workers' oracle for version 2
    report = await sender.send(2)
    record["v2"] = report.summary() | {"staging": max(b.staging_bytes for b in report.buckets)}
    await anyio.to_thread.run_sync(dist.barrier)  # the oracle is written; generation has version 2
    await sender.close()
    return record


async def _generate_side(
    receiver: WeightReceiver, check: Any, initial: dict[str, torch.Tensor], full_path: Path
) -> dict[str, Any]:
    record: dict[str, Any] = {"role": "generate"}
    report = await receiver.receive()
    record["v1_report"] = report.summary() if report else None
    record["v1_staging"] = max(b.staging_bytes for b in report.buckets) if report else None
    async with anyio.create_task_group() as tg:
        async with receiver.weights.use(1) as weights:
            record["v1"] = check(dict(weights), initial)
            snapshot = {n: w.clone() for n, w in weights.items()}
            tg.start_soon(receiver.receive)  # v2 arrives while this lease is held
            await anyio.to_thread.run_sync(dist.barrier)
            await anyio.sleep(0.3)
            record["held_version"] = receiver.weights.version
            record["held_unchanged"] = all(torch.equal(snapshot[n], weights[n]) for n in weights)
        await receiver.weights.wait_version(2)
    await anyio.to_thread.run_sync(dist.barrier)
    async with receiver.weights.use(2) as weights:
        record["v2"] = check(dict(weights), load_file(str(full_path)))
    record["v2_report"] = receiver.last_report.summary() if receiver.last_report else None
    record["after_close"] = await receiver.receive()
    record["closed"] = receiver.closed
    return record


def case_key(case: tuple[int, ...]) -> str:
    """Name of a disaggregated case (R, T, replicas[, staging_bytes])."""
    R, T, replicas, *staging = case
    return f"R{R}-T{T}x{replicas}" + (f"-C{staging[0]}" if staging else "")


def disaggregated_world(
    rank: int, world: int, cases: list[tuple[int, ...]], bucket_bytes: int, out_dir: str
) -> dict[str, Any]:
    """Each case is (R, T, replicas) or (R, T, replicas, staging_bytes); results by :func:`case_key`.

    World ranks 0..R-1 train (FSDP2 over a ``(dp,)`` mesh of those ranks only, as the train stage
    builds it with ``DeviceMesh.from_group``), the others generate. Train rank 0 writes the full
    weights after the step (``full_tensor()``) to ``out_dir``: version 2's oracle on the
    generation side.

    The train stage creates its group with ``use_local_synchronization=True`` once per process.
    Here one world runs several cases, and such a group's name hashes the ranks *and* how many
    groups the calling process already has (torch's ``_hash_ranks_to_str``), which differs between
    ranks that played different roles in earlier cases: the ranks would rendezvous under
    different names and hang. So every rank creates the train groups of all cases up front, as
    ordinary world-collective groups.
    """
    config = tiny_config()
    model_spec = ModelShardingSpec.from_config(config)  # a generation worker's: from the model alone
    initial = dict(build_model(config).state_dict())
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(11))
    train_groups = {R: dist.new_group(list(range(R))) for R in sorted({case[0] for case in cases})}
    meshes: dict[int, DeviceMesh] = {}
    results: dict[str, Any] = {}
    for case in cases:
        R, T, replicas, *staging = case
        topology = Topology.disaggregated(TrainLayout(R, 1), T, replicas)
        groups = build_rank_groups(topology)
        reshard_config = ReshardConfig(bucket_bytes=bucket_bytes, staging_bytes=(staging or [None])[0])
        full_path = Path(out_dir) / f"{case_key(case)}-v2.safetensors"
        if groups.train is not None:
            if R not in meshes:
                meshes[R] = DeviceMesh.from_group(train_groups[R], "cpu", mesh_dim_names=("dp",))
            engine = make_engine(config, meshes[R])
            spec, layout = fsdp2_spec(engine)
            assert layout == topology.train, (layout, topology.train)
            sender = WeightSender(engine, Resharder(spec, groups, config=reshard_config))
            samples = grpo_steps(config, steps=1, seed=5)[0]
            record = anyio.run(_train_side, engine, sender, samples, full_path)
        else:  # as in the pipeline, the generation side's spec comes from the model alone
            receiver = WeightReceiver(Resharder(model_spec, groups, config=reshard_config))

            def check(
                weights: dict[str, torch.Tensor], full: dict[str, torch.Tensor], groups: Any = groups
            ) -> dict[str, Any]:
                return _check_inference(model_spec, config, groups, weights, full, ids)

            record = anyio.run(_generate_side, receiver, check, initial, full_path)
        results[case_key(case)] = record
    return results
