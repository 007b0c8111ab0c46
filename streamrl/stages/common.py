"""What several built-in stages build the same way: the policy model, its tokenizer, the task."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from streamrl.config import RunConfig, resolve_model_dir, task_options
from streamrl.engines.options import EngineName, VllmOptions
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.rollout_engine import RolloutEngine
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.runtime.pipeline import PipelineSpec, class_says, import_stage_class
from streamrl.runtime.stage import Batch, ClaimSize, StageContext
from streamrl.tasks.base import Task
from streamrl.tasks.registry import get_task

if TYPE_CHECKING:  # transformers' model classes take seconds to import; the launcher imports the stages
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def build_tokenizer(cfg: RunConfig) -> PreTrainedTokenizerBase:
    if cfg.model.path is not None:
        from transformers import AutoTokenizer

        # the directory validation checked (a local one, or a hub id in the local cache): never a download
        return with_pad_token(AutoTokenizer.from_pretrained(str(resolve_model_dir(cfg)), local_files_only=True))
    return build_char_tokenizer(cfg.model.extra_chars)


class TokenizerTokensError(ValueError):
    """A tokenizer lacks the end-of-sequence token generation stops at."""


def with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``tokenizer`` with a pad token: its own, else its EOS (many base models define none; padding
    only fills rows and is masked, so which id it is does not matter). Generation stops at EOS, so a
    tokenizer without one is refused."""
    if tokenizer.eos_token_id is None:
        raise TokenizerTokensError("the tokenizer of model.path defines no eos token, so generation could not stop; "
                                   "set eos_token in its tokenizer_config.json (e.g. the chat template's end-of-turn "
                                   "token)")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_policy(cfg: RunConfig, device: str, *, for_training: bool = False
                 ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The initial policy (version 0): every stage that needs it builds the identical model.

    In ``model.dtype``, except for training (``for_training``): the trainer keeps float32 master
    weights and computes in ``model.dtype`` through FSDP2's mixed precision. A lower dtype is a
    cast of the same float32 weights, so every stage still starts from the same version 0. Sets
    the process's float32 matmul precision (``model.matmul_precision``) first.
    """
    from streamrl.models import matmul_precision
    from streamrl.models.build import build_model, load_model

    matmul_precision.apply(cfg.model.matmul_precision)  # this process's, for every stage it runs
    tokenizer = build_tokenizer(cfg)
    if cfg.model.path is not None:
        model = load_model(str(resolve_model_dir(cfg)), dtype=torch.float32, device=device)
    else:
        model = build_model(cfg.model.tiny, tokenizer).to(device)
    if not for_training and cfg.model.dtype != "float32":
        model = model.to(getattr(torch, cfg.model.dtype))
    return model, tokenizer


def build_task(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> Task:
    options: dict[str, Any] = task_options(cfg)  # a jsonl path resolved as validation resolved it
    if cfg.task.name.startswith("digits") and tokenizer is not None:
        options.setdefault("tokenizer", tokenizer)
    return get_task(cfg.task.name, **options)


def open_rollout_engine(ctx: StageContext, engine: EngineName, vllm: VllmOptions, model: PreTrainedModel,
                        tokenizer: PreTrainedTokenizerBase, device: str, *, separate_process: bool = False,
                        sleep_mode: bool = False) -> RolloutEngine:
    """The generate stage's engine over the initial policy ``model`` (version 0).

    ``builtin`` computes on ``model`` itself. ``vllm`` starts a vLLM engine on the same weights:
    ``model.path`` as it is on disk, a tiny model saved into a scratch directory the engine removes
    on close; ``model`` is not used after this. ``separate_process``: see
    :class:`~streamrl.engines.vllm_engine.VllmRolloutEngine`. The engine's scratch lives in the
    run's own directories (``ctx.scratch_dir`` / ``ctx.shm_dir``), so a killed worker's leftovers
    go when the launcher cleans up.
    """
    cfg = ctx.config
    if engine == "builtin":
        model.eval()
        return TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device)
    from streamrl.engines.vllm_engine import VllmRolloutEngine  # vLLM is imported only when asked for
    from streamrl.models.build import save_pretrained_dir

    # short and in the temp dir: vLLM's ipc socket paths go here (a unix socket path has ~107 characters)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-" if ctx.scratch_dir else "srl-vllm-", dir=ctx.scratch_dir))
    try:
        if cfg.model.path is not None:
            model_dir = resolve_model_dir(cfg)
        else:
            model_dir = save_pretrained_dir(model, tokenizer, scratch / "model")
        positions = int(getattr(model.config, "max_position_embeddings", 0) or cfg.algo.max_new_tokens + 2048)
        return VllmRolloutEngine(
            model_dir, eos_token_id=tokenizer.eos_token_id, dtype=cfg.model.dtype,
            max_model_len=vllm.max_model_len or positions, seed=cfg.seed, options=vllm, scratch_dir=scratch,
            device="cpu" if device.startswith("cpu") else device, separate_process=separate_process,
            transfer_root=ctx.shm_dir, sleep_mode=sleep_mode,
        )
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def worker_generator(ctx: StageContext, device: torch.device | str) -> torch.Generator:
    """A generate worker's sampling generator on ``device``, distinct per (run seed, worker)."""
    return torch.Generator(device=device).manual_seed(ctx.config.seed * 1000 + 17 * ctx.worker + 1)


def batch_seed(seed: int, first_key: int) -> int:
    """A micro-batch's sampling seed: distinct per (run seed, first sample key), < 2**63."""
    return (seed * 0x9E3779B97F4A7C15 + first_key * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def seed_for_batch(generator: torch.Generator, seed: int, batch: Batch) -> None:
    """Seed a generate stage's sampler for ``batch`` from its first ``sample_key`` (when the stage
    reads it): a batch generated again after a restart or a resume draws the same tokens."""
    keys = batch.columns.get("sample_key")
    if keys:
        generator.manual_seed(batch_seed(seed, int(keys[0])))


def steps_claimed_one_at_a_time(pipeline: PipelineSpec) -> bool:
    """Every stage that reads ``step`` takes one step's samples a claim (its class says
    ``claims_one_step``: the generate stage in placement separate, a chain with such a link)."""
    readers = [s for s in pipeline.stages if "step" in s.reads]
    return bool(readers) and all(class_says(import_stage_class(s.cls), "claims_one_step", s) for s in readers)


def source_runs_ahead(cfg: RunConfig, pipeline: PipelineSpec | None) -> bool:
    """The source puts a step's prompts one version before theirs (:mod:`streamrl.stages.source`),
    and each generating stage then claims one source reserve at a time: a claim of several steps'
    prompts could wait for a version that needs the first of them trained, which needs that
    claim's samples. Where every stage that reads ``step`` claims one step at a time, and not with
    dynamic sampling, whose source makes waves of a few groups (one reserve each) behind its gate."""
    return (not cfg.algo.dynamic_sampling.enabled and pipeline is not None
            and steps_claimed_one_at_a_time(pipeline))


def step_claim(micro_batch: int, remaining: int, version: int, max_staleness: int) -> ClaimSize:
    """A trainer's next claim: exactly what completes its share of the step (never more, so every
    sample lands in one step), no sample older than ``version - max_staleness``."""
    n = min(micro_batch, remaining)
    oldest = version - max_staleness
    return ClaimSize(n=n, min_n=n, min_version=oldest if oldest > 0 else None)


@dataclass
class StepTally:
    """What a trainer counts over the samples of one optimizer step, for its metrics."""

    consumed: int = 0
    rewards: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # trainer version - sample version
    response_tokens: int = 0
    loss_tokens: int = 0  # response tokens the loss counts (loss_mask 1; all of them without a mask)
    sequence_tokens: int = 0  # prompt + response tokens trained on (for FLOP accounting)
    sample_keys: list[int] = field(default_factory=list)  # when the stage reads sample_key (checkpoints)
    # dynamic sampling: rewards of samples the filter dropped, carried by the step's samples
    # (column dropped_rewards, streamrl.stages.filter): the step's reward figures include them
    dropped_rewards: list[float] = field(default_factory=list)

    def add(self, cols: Mapping[str, Sequence[Any]], versions: Sequence[int], version: int) -> None:
        """A micro-batch's columns and its samples' policy versions, at trainer version ``version``."""
        responses: Sequence[Any] = cols["response_ids"]
        self.consumed += len(versions)
        self.rewards.extend(float(r) for r in cols.get("reward", []))
        self.staleness.extend(version - v for v in versions)
        self.sample_keys.extend(int(k) for k in cols.get("sample_key", []))
        for carried in cols.get("dropped_rewards", []):
            self.dropped_rewards.extend(float(r) for r in carried)
        tokens = sum(int(t.numel()) for t in responses)
        self.response_tokens += tokens
        masks = cols.get("loss_mask")
        self.loss_tokens += sum(int(m.to(torch.bool).sum()) for m in masks) if masks is not None else tokens
        self.sequence_tokens += sum(int(p.numel()) + int(r.numel())
                                    for p, r in zip(cols["prompt_ids"], responses, strict=True))
