"""Rank bodies for the reshard tests (importable by spawned processes) and an independent oracle.

The oracle (:func:`expected_slice`) writes the vLLM fused per-rank layout with plain torch
slicing and ``torch.cat`` from the full weights, without any of streamrl.reshard's rectangle
machinery, so a test comparing the two is a real cross-check.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen2Config

from streamrl.reshard import (
    AdamWConfig,
    ColocatedPolicy,
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    ShardedTrainEngine,
    Topology,
    TrainLayout,
    TrainStateOffloadedError,
    WeightReceiver,
    WeightSender,
    build_rank_groups,
    rope_theta,
    tensor_parallel_logits,
)
from tests.reshard.reshard_harness import build_model, tiny_config

SEQ = 8


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


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches(config: Qwen2Config, steps: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab_size, (rows, SEQ), generator=g) for _ in range(steps)]


def _local_rows(batch: torch.Tensor, layout: TrainLayout, rank: int) -> dict[str, torch.Tensor]:
    dp_rank, _ = layout.coords(rank)
    per = batch.shape[0] // layout.data_parallel
    return {"input_ids": batch[dp_rank * per : (dp_rank + 1) * per]}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# -- colocated: sharded training vs reference, reshard slices, TP logits, accounting, swap --------
def _reference_steps(
    config: Qwen2Config, optim: AdamWConfig, steps: list[torch.Tensor]
) -> tuple[Any, list[float]]:
    """The same steps, unsharded, in one process: the reference for a sharded optimizer step."""
    reference = build_model(config)
    opt = torch.optim.AdamW(reference.parameters(), lr=optim.lr, weight_decay=optim.weight_decay)
    losses = []
    for batch in steps:
        opt.zero_grad()
        loss = lm_loss(reference(input_ids=batch).logits, {"input_ids": batch})
        loss.backward()
        if optim.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), optim.max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
    return reference, losses


def _check_inference(
    spec: ModelShardingSpec,
    config: Qwen2Config,
    groups: Any,
    weights: dict[str, torch.Tensor],
    full: dict[str, torch.Tensor] | None,
    want_logits: torch.Tensor,
    ids: torch.Tensor,
) -> dict[str, Any]:
    """Slices vs the oracle (bitwise, when ``full`` is known) and TP logits vs the full model."""
    T, t = groups.topology.inference.tensor_parallel, groups.inference_rank
    result: dict[str, Any] = {"inference_rank": t}
    if full is not None:
        expected = expected_slice(full, config, T, t)
        result["names_diff"] = sorted(set(weights) ^ set(expected))
        result["mismatched"] = [
            n for n in expected if n in weights and not torch.equal(weights[n], expected[n])
        ]
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
    result["logits_max_diff"] = float((logits - want_logits).abs().max())
    result["logits_shape"] = list(logits.shape)
    return result


def colocated_matrix(
    rank: int, world: int, tp_train: int, inference_tps: list[int], bucket_bytes: int
) -> dict:
    config = tiny_config()
    spec = ModelShardingSpec.from_config(config)
    layout = TrainLayout(world, tp_train)
    optim = AdamWConfig(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    groups_by_t = {T: build_rank_groups(Topology.colocated(layout, T)) for T in inference_tps}
    engine = ShardedTrainEngine(
        build_model(config), spec, groups_by_t[inference_tps[0]].train, optimizer=optim
    )

    steps = batches(config, steps=3, rows=2 * layout.data_parallel)
    losses = [engine.train_step(_local_rows(batch, layout, rank), lm_loss) for batch in steps]
    reference, ref_losses = _reference_steps(config, optim, steps)
    full = engine.full_state_dict()
    initial = build_model(config).state_dict()
    result: dict[str, Any] = {
        "train": {
            "losses": losses,
            "ref_losses": ref_losses,
            "max_param_diff": _max_diff(full, {k: v.detach() for k, v in reference.named_parameters()}),
            "moved_from_init": _max_diff(full, {k: initial[k] for k in full}),
        },
        "by_t": {},
    }

    checker = build_model(config)
    checker.load_state_dict(full)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want_logits = checker(input_ids=ids).logits
    for T in inference_tps:
        groups = groups_by_t[T]
        resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=bucket_bytes))
        out = {n: torch.zeros(s) for n, s in resharder.inference_shapes().items()}
        report = resharder.reshard_local(engine.local_shards(), out, version=1)
        check = _check_inference(spec, config, groups, out, full, want_logits, ids)
        check.update(
            buckets=len(report.buckets),
            peak_extra_bytes=report.peak_extra_bytes,
            largest_bucket_bytes=report.largest_bucket_bytes,
            largest_param_gathered_bytes=max(
                b.gathered_bytes(world, 4) for b in resharder.buckets if len(b.params) == 1
            )
            if any(len(b.params) == 1 for b in resharder.buckets)
            else 0,
            bucket_bytes=bucket_bytes,
            bytes_moved=report.bytes_moved,
            sliced_bytes=report.sliced_bytes,
            inference_bytes=sum(v.numel() * 4 for v in out.values()),
            shard_bytes=sum(v.numel() * 4 for v in engine.local_shards().values()),
            bucket_times=[b.gather_s + b.slice_s for b in report.buckets],
        )
        # the naive baseline on the same shards: one bucket, the whole model gathered at once
        naive = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=None))
        naive_out = {n: torch.zeros(s) for n, s in naive.inference_shapes().items()}
        naive_report = naive.reshard_local(engine.local_shards(), naive_out, version=1)
        check["naive_equal"] = all(torch.equal(naive_out[n], out[n]) for n in out)
        check["naive_peak_extra_bytes"] = naive_report.peak_extra_bytes
        result["by_t"][str(T)] = check
    result["awaitable"] = _awaitable_check(engine, spec, groups_by_t[inference_tps[-1]])
    return result


def _awaitable_check(engine: ShardedTrainEngine, spec: ModelShardingSpec, groups: Any) -> dict[str, Any]:
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
            record["swap_bytes"] = policy.last_swap.bytes if policy.last_swap else 0
            record["reshard_buckets"] = len(report.buckets)
            await anyio.sleep(0.05)
            await policy.to_training()
            record["released_version"] = policy.weights.version
            try:
                await policy.to_training()
            except Exception as exc:  # PhaseError: transitions are checked
                record["double_to_training"] = type(exc).__name__
            done.set()

    anyio.run(main)
    record["engine_on_device"] = not engine.state_on_host
    return record


# -- swap: round trip restores the state bitwise; training with swaps equals training without ----
def _snapshot(engine: ShardedTrainEngine) -> dict[str, torch.Tensor]:
    snap = {}
    for name, p in engine.shards.items():
        snap[f"{name}/data"] = p.data.clone()
        if p.grad is not None:
            snap[f"{name}/grad"] = p.grad.clone()
        for key, value in engine.optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                snap[f"{name}/{key}"] = value.clone()
    return snap


def swap_round_trip(rank: int, world: int, tp_train: int) -> dict:
    config = tiny_config()
    spec = ModelShardingSpec.from_config(config)
    layout = TrainLayout(world, tp_train)
    groups = build_rank_groups(Topology.colocated(layout, world))
    steps = batches(config, steps=4, rows=2 * layout.data_parallel, seed=3)
    plain = ShardedTrainEngine(build_model(config), spec, groups.train)
    swapped = ShardedTrainEngine(build_model(config), spec, groups.train)
    policy = ColocatedPolicy(swapped, Resharder(spec, groups, config=ReshardConfig(bucket_bytes=8192)))
    plain_losses, swapped_losses, refused = [], [], []

    async def run_swapped() -> None:
        for version, batch in enumerate(steps, start=1):
            swapped_losses.append(swapped.train_step(_local_rows(batch, layout, rank), lm_loss))
            await policy.to_inference(version)
            try:
                swapped.train_step(_local_rows(batch, layout, rank), lm_loss)
            except TrainStateOffloadedError:
                refused.append(version)
            async with policy.weights.use(version):
                pass
            await policy.to_training()

    for batch in steps:
        plain_losses.append(plain.train_step(_local_rows(batch, layout, rank), lm_loss))
    anyio.run(run_swapped)
    params_equal = all(torch.equal(plain.shards[n].data, swapped.shards[n].data) for n in plain.shards)

    # a round trip with gradients accumulated mid-step and AdamW moments present
    swapped.forward_backward(_local_rows(steps[0], layout, rank), lm_loss)
    before = _snapshot(swapped)
    out_report = swapped.offload_state()
    storage_on_host = {p.data.data_ptr() for p in swapped.shards.values()}
    in_report = swapped.reload_state()
    after = _snapshot(swapped)
    return {
        "plain_losses": plain_losses,
        "swapped_losses": swapped_losses,
        "params_equal": params_equal,
        "refused_versions": refused,
        "snapshot_kinds": sorted({k.rsplit("/", 1)[1] for k in before}),
        "round_trip_equal": before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
        "storage_moved": not storage_on_host & {p.data.data_ptr() for p in swapped.shards.values()},
        "swap_bytes": out_report.bytes,
        "back_bytes": in_report.bytes,
        "state_bytes": sum(t.numel() * t.element_size() for t in before.values()),
    }


def colocated_world(
    rank: int, world: int, tp_train: int, inference_tps: list[int], bucket_bytes: int
) -> dict:
    """One spawned world, several checks (process start-up dominates the cost of these tests)."""
    return {
        "matrix": colocated_matrix(rank, world, tp_train, inference_tps, bucket_bytes),
        "swap": swap_round_trip(rank, world, tp_train),
    }


# -- disaggregated: train ranks send, generation workers receive under a reader lease -------------
async def _train_side(
    engine: ShardedTrainEngine, sender: WeightSender, batch: dict[str, torch.Tensor]
) -> dict:
    record: dict[str, Any] = {"role": "train"}
    report = await sender.send(1)
    record["v1"] = report.summary() | {"staging": max(b.staging_bytes for b in report.buckets)}
    await anyio.to_thread.run_sync(dist.barrier)  # generation has checked v1 and holds a lease on it
    engine.train_step(batch, lm_loss)
    record["v2"] = (await sender.send(2)).summary()
    await sender.close()
    return record


async def _generate_side(
    receiver: WeightReceiver,
    check: Any,
    initial: dict[str, torch.Tensor],
    want_v1: torch.Tensor,
    want_v2: torch.Tensor,
) -> dict:
    record: dict[str, Any] = {"role": "generate"}
    report = await receiver.receive()
    record["v1_report"] = report.summary() if report else None
    record["v1_staging"] = max(b.staging_bytes for b in report.buckets) if report else None
    async with anyio.create_task_group() as tg:
        async with receiver.weights.use(1) as weights:
            record["v1"] = check(dict(weights), initial, want_v1)
            snapshot = {n: w.clone() for n, w in weights.items()}
            tg.start_soon(receiver.receive)  # v2 arrives while this lease is held
            await anyio.to_thread.run_sync(dist.barrier)
            await anyio.sleep(0.3)
            record["held_version"] = receiver.weights.version
            record["held_unchanged"] = all(torch.equal(snapshot[n], weights[n]) for n in weights)
        await receiver.weights.wait_version(2)
    async with receiver.weights.use(2) as weights:
        record["v2"] = check(dict(weights), None, want_v2)
    record["v2_report"] = receiver.last_report.summary() if receiver.last_report else None
    record["after_close"] = await receiver.receive()
    record["closed"] = receiver.closed
    return record


def case_key(case: tuple[int, ...]) -> str:
    """Name of a disaggregated case (R, T, replicas[, staging_bytes])."""
    R, T, replicas, *staging = case
    return f"R{R}-T{T}x{replicas}" + (f"-C{staging[0]}" if staging else "")


def disaggregated_world(rank: int, world: int, cases: list[tuple[int, ...]], bucket_bytes: int) -> dict:
    """Each case is (R, T, replicas) or (R, T, replicas, staging_bytes); results by :func:`case_key`."""
    config = tiny_config()
    spec = ModelShardingSpec.from_config(config)
    initial = dict(build_model(config).state_dict())
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(11))
    optim = AdamWConfig(lr=1e-2)
    results: dict[str, Any] = {}
    for case in cases:
        R, T, replicas, *staging = case
        topology = Topology.disaggregated(TrainLayout(R, 1), T, replicas)
        groups = build_rank_groups(topology)
        reshard_config = ReshardConfig(bucket_bytes=bucket_bytes, staging_bytes=(staging or [None])[0])
        resharder = Resharder(spec, groups, config=reshard_config)
        step_batch = batches(config, steps=1, rows=2 * R, seed=5)[0]
        if groups.train is not None:
            engine = ShardedTrainEngine(build_model(config), spec, groups.train, optimizer=optim)
            local = _local_rows(step_batch, topology.train, groups.train.rank)
            record = anyio.run(_train_side, engine, WeightSender(engine, resharder), local)
        else:
            stepped = _reference_steps(config, optim, [step_batch])[0]
            with torch.no_grad():
                want_v1 = build_model(config)(input_ids=ids).logits
                want_v2 = stepped(input_ids=ids).logits

            def check(weights: dict, full: dict | None, want: torch.Tensor, groups: Any = groups) -> dict:
                return _check_inference(spec, config, groups, weights, full, want, ids)

            record = anyio.run(_generate_side, WeightReceiver(resharder), check, initial, want_v1, want_v2)
        results[case_key(case)] = record
    return results
