"""The colocated trainer's step equals the single-process trainer's on the same samples.

Two real gloo ranks each train on half of a step's samples with the colocated stage's loss and
batching (``grpo_micro_batch``, ``GrpoLossFn``) and the sharded engine, scaled by R / global
tokens; one process trains on all of them with ``TorchTrainEngine``. After one AdamW step the
parameters must agree (eps = 1 makes AdamW's first update ~ g / (|g| + 1), i.e. proportional to
the gradient instead of its sign, so float noise in tiny gradients cannot flip it): the normalisation by the global token count, the gradient averaging over
ranks and the loss itself are what this checks (the run test only checks that it learns).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from streamrl.algos.grpo import LossConfig, loss_denominator
from streamrl.config import load_config
from streamrl.engines.train import TorchTrainEngine, samples_from_columns
from streamrl.reshard import AdamWConfig, ModelShardingSpec, ShardedTrainEngine, Topology, TrainLayout
from streamrl.reshard import build_rank_groups as _build_rank_groups
from streamrl.stages.colocated import GrpoLossFn, grpo_micro_batch
from streamrl.stages.common import build_policy
from tests.reshard.reshard_harness import run_world

N_SAMPLES = 8
CONFIG = {"model": {"tiny": {"arch": "qwen2", "hidden": 64, "layers": 2, "heads": 4, "intermediate": 128,
                             "max_positions": 64, "seed": 3}}}


def _columns() -> dict[str, list[Any]]:
    """Samples of uneven response lengths (the token normalisation must be global, not per rank)."""
    g = torch.Generator().manual_seed(7)
    cfg = load_config(CONFIG)
    _, tok = build_policy(cfg, "cpu")
    vocab = len(tok)
    cols: dict[str, list[Any]] = {"prompt_ids": [], "response_ids": [], "advantage": [], "rollout_logprobs": []}
    for i in range(N_SAMPLES):
        n = 1 + i % 4
        cols["prompt_ids"].append(torch.randint(0, vocab, (3 + i % 2,), generator=g))
        cols["response_ids"].append(torch.randint(0, vocab, (n,), generator=g))
        cols["advantage"].append(float(torch.randn((), generator=g)))
        cols["rollout_logprobs"].append(-torch.rand(n, generator=g) - 0.5)
    return cols


def _share(cols: dict[str, list[Any]], rank: int, world: int) -> dict[str, list[Any]]:
    per = N_SAMPLES // world
    return {k: v[rank * per:(rank + 1) * per] for k, v in cols.items()}


def _loss_config() -> LossConfig:
    return msgspec.structs.replace(LossConfig(), clip_low=0.2, clip_high=0.2, loss_agg="token-mean")


def colocated_rank_step(rank: int, world: int) -> dict[str, list[float]]:
    torch.manual_seed(0)
    cfg = load_config(CONFIG)
    model, _ = build_policy(cfg, "cpu")
    groups = _build_rank_groups(Topology.colocated(TrainLayout(world), 1))
    assert groups.train is not None
    engine = ShardedTrainEngine(model, ModelShardingSpec.from_config(model.config), groups.train,
                                optimizer=AdamWConfig(lr=1.0, eps=1.0, max_grad_norm=None))
    cols = _columns()
    tokens = sum(int(r.numel()) for r in cols["response_ids"])
    loss_fn = GrpoLossFn(_loss_config(), engine.device)
    mine = _share(cols, rank, world)
    for half in range(2):  # two micro-batches per rank, as claims would deliver them
        part = {k: v[half::2] for k, v in mine.items()}
        engine.forward_backward(grpo_micro_batch(part), loss_fn, loss_scale=world / tokens)
    engine.optimizer_step()
    full = engine.full_state_dict()
    return {name: t.reshape(-1)[:64].tolist() for name, t in full.items()} | {"loss_sum": [loss_fn.sums["loss"]]}


@pytest.mark.timeout(150)
def test_two_colocated_ranks_take_the_single_process_step() -> None:
    ranks = run_world(colocated_rank_step, 2, timeout_s=120)

    torch.manual_seed(0)
    cfg = load_config(CONFIG)
    model, _ = build_policy(cfg, "cpu")
    engine = TorchTrainEngine(model, lr=1.0, eps=1.0, max_grad_norm=None, device="cpu")
    cols = _columns()
    engine.accumulate(samples_from_columns(cols), _loss_config())
    tokens = sum(int(r.numel()) for r in cols["response_ids"])
    stats = engine.step()
    expected = {name: t.reshape(-1)[:64] for name, t in engine.state_dict().items()}

    assert ranks[0].keys() == ranks[1].keys()
    total_loss = ranks[0].pop("loss_sum")[0] + ranks[1].pop("loss_sum")[0]
    assert total_loss / loss_denominator("token-mean", tokens, N_SAMPLES) == pytest.approx(stats["loss"], abs=1e-5)
    for name, values in ranks[0].items():
        torch.testing.assert_close(torch.tensor(values), torch.tensor(ranks[1][name]))  # ranks agree
        torch.testing.assert_close(torch.tensor(values), expected[name], atol=2e-5, rtol=1e-4, msg=name)
