"""Run a function on every rank of a real gloo world of spawned processes, with timeouts.

Each rank joins through a FileStore in a fresh temp dir (no ports), returns a JSON-able value,
and the launcher returns the values by rank. Any rank's exception fails the launch with that
rank's traceback; a world that overruns its deadline is killed, never left behind.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen2Config

WorkerFn = Callable[..., Any]
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers.models.qwen2.modeling_qwen2",
    "streamrl.reshard",
    "anyio",
    "tests.reshard.reshard_workers",  # found when run from the repository root
]


def tiny_config(**overrides: Any) -> Qwen2Config:
    fields: dict[str, Any] = {
        "vocab_size": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    }
    fields.update(overrides)
    return Qwen2Config(**fields)


def build_model(config: PretrainedConfig, seed: int = 0) -> Any:
    """The same random model on every rank: seeded init, float32, eval-free (no dropout in Qwen2)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF zero-inits biases; make them random so a misplaced bias slice shows
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _entry(rank: int, fn: WorkerFn, world_size: int, workdir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    result_path = Path(workdir) / f"result-{rank}.json"
    try:
        value = fn(rank, world_size, *args)
        result_path.write_text(json.dumps({"ok": True, "value": value}))
    except BaseException:
        result_path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


def run_world(fn: WorkerFn, world_size: int, *args: Any, timeout_s: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; values by rank."""
    with tempfile.TemporaryDirectory(prefix="streamrl-reshard-") as workdir:
        # forkserver: the server imports torch/transformers once (preload) and forks each rank from
        # that clean, single-threaded process; plain spawn would re-import them in every rank (~10 s
        # per world on a loaded 2-core machine). Python 3.11's forkserver ignores the parent's
        # sys.path for preloading, so only installed packages are preloaded here.
        # The forkserver is one per process: keep what other tests (the runtime's launcher) asked for.
        current = list(getattr(multiprocessing.forkserver._forkserver, "_preload_modules", None) or [])
        mp.set_forkserver_preload(current + [m for m in PRELOAD if m not in current])
        context = mp.start_processes(
            _entry,
            args=(fn, world_size, workdir, args),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"world of {world_size} ranks running {fn.__name__} overran {timeout_s}s"
                    )
        except mp.ProcessRaisedException as exc:
            errors = _errors(workdir, world_size)
            raise AssertionError(f"{fn.__name__} failed:\n{errors or exc}") from None
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join(timeout=10)
        results = []
        for rank in range(world_size):
            record = json.loads((Path(workdir) / f"result-{rank}.json").read_text())
            if not record["ok"]:
                raise AssertionError(f"rank {rank} of {fn.__name__} failed:\n{record['error']}")
            results.append(record["value"])
        return results


def _errors(workdir: str, world_size: int) -> str:
    out = []
    for rank in range(world_size):
        path = Path(workdir) / f"result-{rank}.json"
        if path.exists():
            record = json.loads(path.read_text())
            if not record["ok"]:
                out.append(f"--- rank {rank} ---\n{record['error']}")
    return "\n".join(out)
