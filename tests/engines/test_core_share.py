"""The host's core share (streamrl.engines.core_share): real processes marking their compute
calls, the thread counts each gets, the cap by a call's work, and the engines' rebalance points
(prefill and decode steps, decoder layers forward and backward) with the work they pass."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from streamrl.algos.grpo import LossConfig
from streamrl.engines import core_share, rollout
from streamrl.engines.core_share import DECODE_GRAIN, LAYER_GRAIN, CoreShare, CoreShareError, rebalance
from streamrl.engines.fsdp import FSDPTrainEngine
from streamrl.engines.logprob import LogprobEngine
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.samples import TrainSample
from tests.engines.conftest import TINY, encode

# a process that computes under the share of DIR until its stdin closes: prints "in" once inside
HOLDER = """
import sys
from pathlib import Path
from streamrl.engines.core_share import CoreShare
share = CoreShare(Path(sys.argv[1]), threads=1, cores=4)
with share.computing():
    print("in", flush=True)
    sys.stdin.read()
"""


class RecordingShare(CoreShare):
    """A real share that also keeps the work each rebalance was given."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.works: list[int | None] = []
        self.grains: list[int | None] = []

    def rebalance(self, work: int | None = None, grain: int | None = None) -> int:
        self.works.append(work)
        self.grains.append(grain)
        return super().rebalance(work, grain)


class Holder:
    """Another real process computing under the same share directory, for as long as it is open."""

    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until it computes (or fails: then "")
        assert line.strip() == "in", f"the holder process did not start computing (exit {self.proc.poll()})"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


pytestmark = pytest.mark.usefixtures("restore_threads")


def test_a_call_computing_alone_gets_its_stages_threads(tmp_path: Path) -> None:
    share = CoreShare(tmp_path / "cores", threads=3, cores=4)
    with share.computing():
        assert torch.get_num_threads() == 3
        assert share.busy() == 1
        assert len(os.listdir(tmp_path / "cores")) == 1  # this thread's marker
    assert os.listdir(tmp_path / "cores") == []
    stats = share.statistics()
    assert (stats.calls, stats.rebalances, stats.threads) == (1, 1, 3)


def test_computing_processes_split_the_cores_and_get_them_back(tmp_path: Path) -> None:
    directory = tmp_path / "cores"
    share = CoreShare(directory, threads=4, cores=4)
    with share.computing():
        assert torch.get_num_threads() == 4
        holder = Holder(directory)
        try:
            assert share.busy() == 2
            assert share.rebalance() == 2 and torch.get_num_threads() == 2
        finally:
            holder.close()
        assert share.rebalance() == 4 and torch.get_num_threads() == 4  # alone again
    assert share.statistics().changes >= 2
    assert os.listdir(directory) == []  # both markers gone


def test_more_computing_threads_than_cores_get_one_each(tmp_path: Path) -> None:
    directory = tmp_path / "cores"
    holders = [Holder(directory), Holder(directory)]
    try:
        share = CoreShare(directory, threads=2, cores=2)
        with share.computing():
            assert share.busy() == 3
            assert torch.get_num_threads() == 1
    finally:
        for h in holders:
            h.close()


def test_a_killed_workers_marker_counts_no_more(tmp_path: Path) -> None:
    directory = tmp_path / "cores"
    directory.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    (directory / f"{dead.pid}-1").touch()  # what a worker killed inside a compute call leaves
    (directory / "not-a-marker").touch()
    share = CoreShare(directory, threads=2, cores=2)
    with share.computing():
        assert share.busy() == 1
        assert torch.get_num_threads() == 2


def test_the_marker_goes_when_the_call_fails_and_nested_calls_share_it(tmp_path: Path) -> None:
    share = CoreShare(tmp_path / "cores", threads=2, cores=2)
    with pytest.raises(RuntimeError, match="boom"), share.computing():
        with share.computing():  # e.g. a compute call that calls another engine's
            assert len(os.listdir(tmp_path / "cores")) == 1
        raise RuntimeError("boom")
    assert os.listdir(tmp_path / "cores") == []
    assert share.statistics().calls == 1


def test_threads_of_one_process_each_count(tmp_path: Path) -> None:
    """Colocated stages compute in threads of one process: each thread is one busy marker."""
    share = CoreShare(tmp_path / "cores", threads=2, cores=2)
    inside, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def other() -> None:
        with share.computing():
            inside.set()
            release.wait(timeout=30)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(timeout=30)
        with share.computing():
            seen.append(share.busy())
            seen.append(torch.get_num_threads())
    finally:
        release.set()
        t.join(timeout=30)
    assert seen == [2, 1]


def test_small_work_gets_one_thread_per_grain(tmp_path: Path) -> None:
    """A team forms only where the work pays for it: one thread per grain of rows x width^2."""
    share = CoreShare(tmp_path / "cores", threads=4, cores=4)
    with share.computing():
        assert torch.get_num_threads() == 4  # the call's start: no work named yet
        assert share.rebalance(LAYER_GRAIN - 1) == 1 and torch.get_num_threads() == 1
        assert share.rebalance(0) == 1  # an empty layer still computes on one thread
        assert share.rebalance(2 * LAYER_GRAIN) == 2 and torch.get_num_threads() == 2
        assert share.rebalance(3 * LAYER_GRAIN + 5) == 3
        assert share.rebalance(100 * LAYER_GRAIN) == 4  # never more than the stage's threads
        assert share.rebalance(None) == 4
        # a decode step's grain is its own: it gains from a second thread at less work
        assert DECODE_GRAIN < LAYER_GRAIN
        assert share.rebalance(2 * DECODE_GRAIN, DECODE_GRAIN) == 2
        holder = Holder(tmp_path / "cores")
        try:
            assert share.rebalance(100 * LAYER_GRAIN) == 2  # nor more than its share of the cores
        finally:
            holder.close()


def test_the_grain_is_measured_in_rows_times_width_squared() -> None:
    assert core_share.layer_work(torch.zeros(3, 5, 16)) == 15 * 16 * 16
    assert core_share.layer_work(torch.zeros(7, 8)) == 7 * 8 * 8
    assert core_share.layer_work(torch.tensor(1.0)) is None
    assert core_share.layer_work(None) is None


def test_rebalance_outside_a_share_changes_nothing(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    rebalance()
    assert torch.get_num_threads() == 1
    share = CoreShare(tmp_path / "cores", threads=2, cores=2)
    assert share.statistics().rebalances == 0


def test_bad_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(CoreShareError, match="threads must be >= 1"):
        CoreShare(tmp_path, threads=0)
    with pytest.raises(CoreShareError, match="cores must be >= 1"):
        CoreShare(tmp_path, threads=1, cores=0)


# --- the engines' rebalance points --------------------------------------------------------


def test_generation_names_the_work_of_its_prefill_and_decode_steps(
    tmp_path: Path, tok: PreTrainedTokenizerFast, model: torch.nn.Module
) -> None:
    engine = TorchRolloutEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id, device="cpu")
    share = RecordingShare(tmp_path / "cores", threads=2, cores=2)
    prompts = encode(tok, ["12=", "345="]) * 3  # 2 unique prompts share their prefill rows
    width = max(len(p) for p in prompts)
    with share.computing():
        engine.generate(prompts, max_new_tokens=4, seed=0)
    square = TINY.hidden**2
    # the call's start, the prefill (2 padded rows), then before each of the 3 decode steps of 6
    # rows (the 4th token is sampled, never fed)
    assert share.works == [None, 2 * width * square] + [6 * square] * 3
    assert share.grains == [None, None] + [DECODE_GRAIN] * 3  # the prefill is a layer's
    assert share.statistics().threads == 1  # a tiny model's steps never pay for a team


def test_a_small_call_uses_one_thread_and_a_large_one_a_team(
    tmp_path: Path, tok: PreTrainedTokenizerFast, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = TorchRolloutEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id, device="cpu")
    share = CoreShare(tmp_path / "cores", threads=2, cores=2)
    seen: list[int] = []
    original = engine._sample

    def sample(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)  # type: ignore[arg-type]

    engine._sample = sample  # type: ignore[method-assign]
    with share.computing():
        engine.generate(encode(tok, ["12="]) * 4, max_new_tokens=3, seed=0)
    assert seen == [1, 1, 1]
    # a decode grain of 2 rows' work: the 4 decode rows pay for a team of 2; the prefill (one
    # shared row of 3 tokens, a layer's grain) does not
    monkeypatch.setattr(rollout, "DECODE_GRAIN", 2 * TINY.hidden**2)
    seen.clear()
    with share.computing():
        engine.generate(encode(tok, ["12="]) * 4, max_new_tokens=3, seed=0)
    assert seen == [1, 2, 2]


def test_a_decode_step_takes_the_share_of_the_moment(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                     model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process starts computing while generation runs: the next decode step halves the threads."""
    monkeypatch.setattr(core_share, "LAYER_GRAIN", 1)  # the tiny model's prefill and steps count as large
    monkeypatch.setattr(rollout, "DECODE_GRAIN", 1)
    directory = tmp_path / "cores"
    engine = TorchRolloutEngine(model, eos_token_id=-1, pad_token_id=tok.pad_token_id, device="cpu")
    share = CoreShare(directory, threads=4, cores=4)
    seen: list[int] = []
    holder: list[Holder] = []
    original = engine._sample

    def sample(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        if len(seen) == 2:
            holder.append(Holder(directory))
        return original(*args, **kwargs)  # type: ignore[arg-type]

    engine._sample = sample  # type: ignore[method-assign]
    try:
        with share.computing():
            engine.generate(encode(tok, ["12="]), max_new_tokens=4, seed=0)
    finally:
        for h in holder:
            h.close()
    assert seen == [4, 4, 2, 2]


def test_training_rebalances_before_each_layers_forward_and_backward_with_its_work(
    tmp_path: Path, tok: PreTrainedTokenizerFast, model: torch.nn.Module, world_of_one: None
) -> None:
    engine = FSDPTrainEngine(model, lr=1e-3, device="cpu")
    prompt = encode(tok, ["12="])[0]
    samples = [TrainSample(prompt, torch.tensor([5, 6, 7]), advantage=a) for a in (1.0, -1.0)]
    share = RecordingShare(tmp_path / "cores", threads=2, cores=2)
    with share.computing():
        engine.accumulate(samples, LossConfig())
    # the call's start, then each layer's forward and each layer's backward (one row: one forward)
    assert share.works[0] is None
    layers = share.works[1:]
    assert len(layers) == 2 * TINY.layers
    engine.step()  # outside the share: the hooks do nothing there
    assert share.statistics().rebalances == 1 + 2 * TINY.layers
    # one packed row (the shared prompt once, then both responses): its tokens x width^2, the same
    # for every layer's forward (its input) and backward (its output's gradient)
    tokens = len(layers) and layers[0] // TINY.hidden**2  # type: ignore[operator]
    assert len(prompt) + 2 * 2 <= tokens <= len(prompt) + 2 * 3  # a response's last token may not be fed
    assert layers == [tokens * TINY.hidden**2] * len(layers)


def test_the_optimizer_step_names_the_parameters_it_sweeps_at_the_elementwise_grain(
    tmp_path: Path, tok: PreTrainedTokenizerFast, model: torch.nn.Module, world_of_one: None,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step (gradient scaling and norm, AdamW) rebalances once, with this rank's parameter count
    at ELEMENTWISE_GRAIN: a small model's step runs on one thread even when its stage computes alone
    on two, and a model of two grains gets the team."""
    engine = FSDPTrainEngine(model, lr=1e-3, device="cpu")
    prompt = encode(tok, ["12="])[0]
    samples = [TrainSample(prompt, torch.tensor([5, 6, 7]), advantage=a) for a in (1.0, -1.0)]
    params = sum(p.numel() for p in model.parameters())
    share = RecordingShare(tmp_path / "cores", threads=2, cores=2)
    engine.accumulate(samples, LossConfig())  # outside the share: its hooks do nothing
    with share.computing():
        engine.step()
    assert share.works == [None, params] and share.grains == [None, core_share.ELEMENTWISE_GRAIN]
    assert params < core_share.ELEMENTWISE_GRAIN and torch.get_num_threads() == 1
    monkeypatch.setattr(core_share, "ELEMENTWISE_GRAIN", params // 2)
    engine.accumulate(samples, LossConfig())
    with share.computing():
        engine.step()
    assert share.statistics().threads == 2 and torch.get_num_threads() == 2


def test_reference_logprobs_rebalance_before_each_layer(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                       model: torch.nn.Module) -> None:
    engine = LogprobEngine(model, device="cpu")
    share = CoreShare(tmp_path / "cores", threads=2, cores=2)
    with share.computing():
        engine.logprobs(encode(tok, ["12="]), [torch.tensor([5, 6])])
    assert share.statistics().rebalances == 1 + TINY.layers  # no backward


def test_reference_logprobs_name_each_layers_work(tmp_path: Path, tok: PreTrainedTokenizerFast,
                                                  model: torch.nn.Module) -> None:
    engine = LogprobEngine(model, device="cpu")
    share = RecordingShare(tmp_path / "cores", threads=2, cores=2)
    prompt = encode(tok, ["12="])[0]
    with share.computing():
        engine.logprobs([prompt], [torch.tensor([5, 6])])
    works = share.works[1:]
    assert len(works) == TINY.layers
    # the prompt and the response, whose last token may not be fed: tokens x width^2 per layer
    assert works[0] is not None and works[0] % TINY.hidden**2 == 0
    assert len(prompt) + 1 <= works[0] // TINY.hidden**2 <= len(prompt) + 2
    assert works == [works[0]] * TINY.layers
