"""The chain stage (streamrl.stages.chain): links checked as stages of their own before anything
starts, run in order on one claim, closed on every path; and a chained GRPO run that takes the
same steps as the unchained one."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.dock.protocol import SampleInfo
from streamrl.runtime.pipeline import PipelineSpec, class_says
from streamrl.runtime.prerun import load_pipeline
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.chain import ChainStage
from tests.metrics.test_trace import assert_spans_nest
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
CHAINED = yaml.safe_load((REPO / "pipelines" / "grpo_chained.yaml").read_text())
HERE = "tests.stages.test_chain"


def _chain(p: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in p["stages"] if s["name"] == "reward")


def _load(tmp_path: Path, mutate: Any = None, overrides: list[str] | None = None,
          base: dict[str, Any] = CHAINED) -> PipelineSpec:
    """``base`` (a pipeline file's YAML) changed by ``mutate``, written to ``tmp_path`` and loaded."""
    p = copy.deepcopy(base)
    if mutate is not None:
        mutate(p)
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return load_pipeline(load_config({"pipeline": str(path)}, overrides))


def _error(tmp_path: Path, mutate: Any, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, mutate, overrides)
    return str(info.value)


def test_the_shipped_chained_pipeline_is_valid() -> None:
    spec = load_pipeline(load_config({"pipeline": str(REPO / "pipelines" / "grpo_chained.yaml")}))
    assert [s.name for s in spec.stages] == ["source", "generate", "reward", "train"]
    assert spec.consumers == ["generate", "reward", "train"]
    reward = spec.stage("reward")
    assert reward.restartable  # both links are
    assert class_says(ChainStage, "uses_model_and_task", reward)  # the score link loads the task


def test_the_shipped_rollout_pipeline_is_valid_and_generates() -> None:
    """pipelines/grpo_rollout.yaml: generate, score and advantage on one claim, the chain a generator."""
    spec = load_pipeline(load_config({"pipeline": str(REPO / "pipelines" / "grpo_rollout.yaml")}))
    assert [s.name for s in spec.stages] == ["source", "rollout", "train"]
    assert spec.consumers == ["rollout", "train"]
    rollout = spec.stage("rollout")
    assert rollout.restartable  # placement separate: the generate link fetches its weights itself
    assert class_says(ChainStage, "generates", rollout)  # the pre-run checks fit prompt + completion
    assert not class_says(ChainStage, "generates", spec.stage("train"))


def test_a_chain_generates_only_in_placement_separate(tmp_path: Path) -> None:
    p = yaml.safe_load((REPO / "pipelines" / "grpo_rollout.yaml").read_text())
    p["placement"] = "colocated"
    p["stages"][1]["colocate_with"] = "train"
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    with pytest.raises(ConfigError, match=r"stage 'rollout' options.links\[0\] \('generate'\).class: a chain "
                                          r"generates in placement separate only"):
        load_pipeline(load_config({"pipeline": str(path)}))


def _set(path: str, value: Any) -> Any:
    """A mutation that sets ``links[k].key`` (``path`` "k.key") or a field of the chain stage ("key")."""
    def mutate(p: dict[str, Any]) -> None:
        chain = _chain(p)
        if "." in path:
            k, key = path.split(".")
            chain["options"]["links"][int(k)][key] = value
        else:
            chain[path] = value
    return mutate


@pytest.mark.parametrize(("mutate", "expected"), [
    (_set("0.class", "streamrl.stages.nope:Score"), "options.links[0] ('score').class: class "),
    (_set("0.options", {"bakend": "zmq"}), "options.links[0] ('score') options: score stage: unknown options ['bakend']"),
    (_set("1.options", {"x": 1}), "options.links[1] ('advantage') options: unknown option 'x'"),
    (_set("1.name", "score"), "options.links[1] ('score'): name must be letters, digits, '-' or '_', and unique"),
    (_set("1.class", "streamrl.stages.train:TrainStage"), "cannot be chained: it trains the policy"),
    (_set("1.class", "streamrl.stages.generate:GenerateStage"),
     "stage 'advantage' reads ['reward']: the generate stage samples from the prompts' tokens; add prompt_ids"),
    (_set("1.class", "streamrl.stages.filter:FilterStage"), "set algo.dynamic_sampling.enabled: true"),
    (_set("1.class", "streamrl.stages.chain:ChainStage"), "a chain cannot be a link of a chain"),
    (_set("1.reads", []), "options.links[1] ('advantage').reads: a link processes claimed samples"),
    (_set("0.writes", ["reward", "advantage"]), "'advantage' is already written by an earlier link"),
    (_set("0.reads", ["prompt", "answer", "response_ids", "advantage"]),
     "link 'advantage', which comes after it, writes it"),
    (_set("1.reads", ["reward", "rollout_logprobs"]), "add it to the chain's reads"),
    (_set("reads", ["prompt", "answer", "response_ids", "prompt_ids"]), "reads ['prompt_ids'], which no link reads"),
    (_set("writes", ["reward", "advantage", "extra"]),
     "the chain's writes must be its links' writes: set writes: ['reward', 'advantage']"),
    (_set("whole_groups", False), "stage 'advantage': the advantage stage normalises rewards within a group"),
    (_set("options", {"links": []}), "a chain needs at least one link"),
    (_set("options", {"links": [{"name": "a", "class": "x:Y", "reads": ["reward"], "writes": ["w"], "opts": {}}]}),
     "unknown option"),
])
def test_a_chain_is_checked_link_by_link_before_anything_starts(tmp_path: Path, mutate: Any, expected: str) -> None:
    message = _error(tmp_path, mutate)
    assert "pipe.yaml: stage 'reward'" in message
    assert expected in message


def test_a_links_own_spec_check_sees_the_run(tmp_path: Path) -> None:
    """The advantage link's check_spec, as on its own: KL in the reward needs the columns it reads."""
    def kl(p: dict[str, Any]) -> None:
        p["stages"].insert(2, {"name": "reference", "class": "streamrl.stages.reference:ReferenceStage",
                               "reads": ["prompt_ids", "response_ids"], "writes": ["ref_logprobs"]})
    message = _error(tmp_path, kl, ["algo.loss.kl_coef=0.1", "algo.loss.kl_in=reward"])
    assert "stage 'reward' options.links[1]: stage 'advantage'" in message and "must read ['ref_logprobs', 'rollout_logprobs']" in message


def test_a_run_config_sets_a_links_options_by_its_name(tmp_path: Path) -> None:
    """``stages.score.options`` reaches the score link as it would the score stage of pipelines/grpo.yaml."""
    spec = _load(tmp_path, overrides=["stages.score.options={on_sample_error: default, default_score: 0.5}",
                                      "stages.reward.micro_batch=32"])
    reward = spec.stage("reward")
    assert reward.micro_batch == 32
    assert reward.options["links"][0]["options"] == {"on_sample_error": "default", "default_score": 0.5}
    assert reward.options["links"][1].get("options", {}) == {}
    message = _error(tmp_path, None, ["stages.score.options={bakend: zmq}"])
    assert "options.links[0] ('score') options: score stage: unknown options ['bakend']" in message
    message = _error(tmp_path, None, ["stages.score.workers=2"])
    assert "stages.score sets ['workers'] of link 'score', which runs inside the chain stage 'reward'" in message
    assert "set stages.reward.workers instead" in message
    assert "does not have" in _error(tmp_path, None, ["stages.scorer.workers=2"])


# ------------------------------------------------------------------ links run in order, in process

class Doubler:
    """A link: ``double`` = 2 x ``value``; reports a metric and records its calls in ``log``."""

    log: ClassVar[list[str]] = []
    fail_setup = False
    fail_close = False
    restartable = True

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.log.append(f"setup {ctx.spec.name}")
        if self.fail_setup:
            raise RuntimeError("setup failed")

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        self.ctx.report_metrics({"n": len(batch)})
        return {self.ctx.spec.writes[0]: [2 * v for v in batch.columns[self.ctx.spec.reads[0]]]}

    async def close(self) -> None:
        self.log.append(f"close {self.ctx.spec.name}")
        if self.fail_close:
            raise RuntimeError(f"close of {self.ctx.spec.name} failed")


class FailingSetup(Doubler):
    fail_setup = True


class FailingClose(Doubler):
    fail_close = True


class Versioned(Doubler):
    restartable = False

    async def process(self, batch: Batch) -> Output:
        out = await super().process(batch)
        return Output(out, versions=[7] * len(batch), lengths=[3] * len(batch))


class DropOdd(Doubler):
    """A link that drops every sample with an odd value, like the filter drops uniform groups."""

    async def process(self, batch: Batch) -> Output:
        values = batch.columns[self.ctx.spec.reads[0]]
        self.log.append(f"{self.ctx.spec.name} got {values}")
        return Output({self.ctx.spec.writes[0]: values}, discard=[v % 2 == 1 for v in values])


class _Control:
    """What a link's metrics reach: the worker's control channel records them here."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def stage_metrics(self, metrics: dict[str, float], *, defer: bool = False) -> None:
        self.metrics.append(metrics)


def _links(*links: tuple[str, str, str, str]) -> dict[str, Any]:
    return {"links": [{"name": n, "class": f"{HERE}:{cls}", "reads": [r], "writes": [w]} for n, cls, r, w in links]}


def _context(tmp_path: Path, options: dict[str, Any], control: _Control) -> StageContext:
    from streamrl.runtime.pipeline import StageSpec

    spec = StageSpec(name="chain", cls="streamrl.stages.chain:ChainStage", reads=["value"],
                     writes=[lk["writes"][0] for lk in options["links"]], options=options)
    return StageContext(load_config({}), spec, 0, tmp_path, "cpu", None, control, "")  # type: ignore[arg-type]


def _batch(values: list[int]) -> Batch:
    return Batch([SampleInfo(index=i, group=i, group_size=1, version=0, length=1) for i in range(len(values))],
                 {"value": values})


@pytest.mark.anyio
async def test_links_run_in_order_each_on_what_the_ones_before_wrote(tmp_path: Path) -> None:
    Doubler.log = []
    control = _Control()
    chain = ChainStage()
    await chain.setup(_context(tmp_path, _links(("a", "Doubler", "value", "double"),
                                                ("b", "Versioned", "double", "quadruple")), control))
    out = await chain.process(_batch([1, 2, 3]))
    assert out.columns == {"double": [2, 4, 6], "quadruple": [4, 8, 12]}
    assert out.versions == [7, 7, 7] and out.lengths == [3, 3, 3]  # a link's versions and lengths pass on
    assert control.metrics == [{"a/n": 3}, {"b/n": 3}]  # each link's metrics under its name
    await chain.close()
    assert Doubler.log == ["setup a", "setup b", "close b", "close a"]


@pytest.mark.anyio
async def test_the_links_after_one_that_drops_samples_see_only_those_it_kept(tmp_path: Path) -> None:
    Doubler.log = []
    chain = ChainStage()
    await chain.setup(_context(tmp_path, _links(("drop", "DropOdd", "value", "kept"), ("a", "Doubler", "kept", "x"),
                                                ("b", "DropOdd", "x", "y")), _Control()))
    out = await chain.process(_batch([1, 2, 3, 4]))
    # positions 0 and 2 dropped by the first link; the last link drops none of 4, 8
    assert out.discard == [True, False, True, False]
    # a dropped sample's values are never stored (the worker puts only the kept ones)
    assert out.columns == {"kept": [1, 2, 3, 4], "x": [None, 4, None, 8], "y": [None, 4, None, 8]}
    assert "b got [4, 8]" in Doubler.log
    out = await chain.process(_batch([1, 3]))  # all dropped: the links after it are not called
    assert out.discard == [True, True] and out.columns == {"kept": [1, 3], "x": [None, None], "y": [None, None]}
    await chain.close()


@pytest.mark.anyio
async def test_a_link_that_fails_set_up_closes_the_ones_before_it(tmp_path: Path) -> None:
    Doubler.log = []
    chain = ChainStage()
    with pytest.raises(RuntimeError, match="setup failed"):
        await chain.setup(_context(tmp_path, _links(("a", "Doubler", "value", "x"), ("b", "FailingSetup", "x", "y"),
                                                    ("c", "Doubler", "y", "z")), _Control()))
    assert Doubler.log == ["setup a", "setup b", "close a"]  # b did not set up; c never started


@pytest.mark.anyio
async def test_every_link_closes_even_where_one_fails_to(tmp_path: Path) -> None:
    Doubler.log = []
    chain = ChainStage()
    await chain.setup(_context(tmp_path, _links(("a", "Doubler", "value", "x"), ("b", "FailingClose", "x", "y"),
                                                ("c", "FailingClose", "y", "z")), _Control()))
    with pytest.raises(RuntimeError, match="close of c failed"):  # the first failure, the others still closed
        await chain.close()
    assert Doubler.log[-3:] == ["close c", "close b", "close a"]


@pytest.mark.anyio
async def test_a_link_returning_other_columns_than_it_writes_fails_naming_it(tmp_path: Path) -> None:
    options = _links(("a", "Doubler", "value", "x"))
    chain = ChainStage()
    await chain.setup(_context(tmp_path, options, _Control()))
    chain.links[0][0].writes.append("extra")  # it now says it writes a column it does not return
    with pytest.raises(ValueError, match=r"chain link 'a'.*missing \['extra'\]"):
        await chain.process(_batch([1]))
    await chain.close()


def test_a_chain_is_restartable_where_every_link_is() -> None:
    from streamrl.runtime.pipeline import StageSpec

    def spec(*classes: str) -> StageSpec:
        options = _links(*((f"l{k}", c, "value", f"c{k}") for k, c in enumerate(classes)))
        return StageSpec(name="chain", cls="streamrl.stages.chain:ChainStage", options=options)

    assert class_says(ChainStage, "restartable", spec("Doubler", "Doubler"))
    assert not class_says(ChainStage, "restartable", spec("Doubler", "Versioned"))
    assert not class_says(ChainStage, "restartable", StageSpec(name="c", cls="x:Y", options={"links": "bad"}))


# ------------------------------------------------------------------ a chained run

def _span_names(run_dir: Path) -> set[tuple[str, str, str | None]]:
    """(stage, span, category) of every span in a run's trace, which must nest (each link's span
    inside the chain's batch)."""
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert_spans_nest(events)
    stage_of = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    return {(stage_of[e["pid"]], e["name"], e.get("cat")) for e in events if e["ph"] == "X"}


SYNC_LINKS = ("generate", "score", "advantage")


@pytest.mark.parametrize(("pipeline", "chain", "links", "figure", "extra"), [
    # scoring and advantages on one claim
    ("grpo_chained.yaml", "reward", ("score", "advantage"), "reward/score/latency_p50_ms", ()),
    # generation too: the chain waits for its policy versions and installs them as the generate stage does
    ("grpo_rollout.yaml", "rollout", ("generate", "score", "advantage"), "rollout/generate/weight_install_s", ()),
    # the train stage's own links (options.rollout): generation on the module it trains, in its process
    ("grpo_sync.yaml", "train", SYNC_LINKS, "train/score/latency_p50_ms", ()),
    # ... and on a copy of it, installed after each step, where the engine shards it (FSDP2, here for the
    # offload of its state to the host)
    ("grpo_sync.yaml", "train", SYNC_LINKS, "train/score/latency_p50_ms", ("stages.train.options.cpu_offload=true",)),
])
def test_a_chained_grpo_run_takes_the_steps_of_the_unchained_one(
        tmp_path: Path, single_trainer_digits: streamrl.RunResult, pipeline: str, chain: str, links: tuple[str, ...],
        figure: str, extra: tuple[str, ...]) -> None:
    """Stages chained on one claim change no number: every step's reward, loss and staleness are the
    unchained run's (tests/conftest.py's single_trainer_digits, the same config and budget; each
    generated batch's sampler seeded by its first sample key). So does generating in the train
    stage (tests/stages/test_train_rollout.py has its rules)."""
    from tests.conftest import SINGLE_BUDGET

    before = ipc_dirs()
    chained = streamrl.run(REPO / "configs" / "grpo_digits.yaml", [
        f"output.run_dir={tmp_path}", "output.progress=none", "output.tensorboard=false", "output.plot=false",
        f"algo.steps={SINGLE_BUDGET}", f"pipeline={REPO / 'pipelines' / pipeline}", *extra])
    one = single_trainer_digits
    assert chained.steps == one.steps and chained.stop_reason == one.stop_reason
    for a, b in zip(chained.metrics, one.metrics, strict=True):
        assert (a["step"], a["reward_mean"], a["loss"], a["staleness_max"]) == (
            b["step"], b["reward_mean"], b["loss"], b["staleness_max"])
    last = chained.metrics[-1]
    assert f"busy/{chain}" in last and not any(f"busy/{link}" in last for link in links)
    assert figure in last  # a link's figures, under its name
    names = _span_names(chained.run_dir)
    assert {(chain, "process", "batch")} | {(chain, link, "chain") for link in links} <= names
    if chain == "train":  # no process but the source's and its own; no weights to fetch or install
        assert set(chained.worker_logs) == {"source-0", "train-0"}
        assert not any(name == "install weights" for _, name, _ in names)
        unwrapped = "the module unwrapped" in chained.worker_logs["train-0"].read_text()
        assert unwrapped == (not extra)  # the offload wraps it: generation then ran on the copy
    elif "generate" in links:
        assert (chain, "install weights", "policy") in names
    assert_run_cleaned(chained.run_dir, os.getpid(), before)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("pipeline", "chain", "stages"), [
    ("dapo_chained.yaml", "reward", ("generate", "reward", "train")),
    ("dapo_rollout.yaml", "rollout", ("rollout", "train")),  # the generator a link of the chain
])
def test_a_chained_filter_drops_groups_and_the_source_makes_up_for_them(
        tmp_path: Path, pipeline: str, chain: str, stages: tuple[str, ...]) -> None:
    """pipelines/dapo_chained.yaml and dapo_rollout.yaml: the filter link drops uniform groups from
    the run (the dock's discard), the advantage link sees only the kept ones, and every step still
    gets its quota."""
    from tests.e2e.test_dynamic_sampling import STEPS, G, P, _config

    config = _config(tmp_path)
    raw = yaml.safe_load(config.read_text())
    raw["pipeline"] = str(REPO / "pipelines" / pipeline)
    raw["stages"] = {s: {"micro_batch": 16} for s in stages}
    raw["output"]["checkpoint_every"] = 0
    config.write_text(yaml.safe_dump(raw))
    before = ipc_dirs()
    result = streamrl.run(config, run_dir=tmp_path / "run")
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["samples"] == P * G for r in rows), [r["samples"] for r in rows]
    assert all(r["uniform_groups"] == 0 for r in rows)  # the advantage link never saw a dropped group
    assert sum(r["dropped_samples"] for r in rows) > 0, "nothing dropped: dynamic sampling was not exercised"
    assert 0 < rows[-1][f"{chain}/filter/kept_fraction"] < 1
    assert result.dock_statistics["samples_discarded"] > 0
    assert_run_cleaned(result.run_dir, os.getpid(), before)
