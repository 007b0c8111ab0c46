"""The vLLM engine's environment variables: its own ipc directory always wins over an inherited one,
and closing puts the process's environment back (child processes must not inherit a removed dir).

Runs without vLLM installed: only the environment handling is exercised here; the engine itself is
in test_vllm_engine.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from streamrl.engines.options import VllmOptions
from streamrl.engines.vllm_engine import configure_vllm_environment, restore_environment


def test_the_engines_ipc_dir_replaces_a_stale_one_and_close_restores_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = str(tmp_path / "removed-by-an-earlier-engine")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", stale)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's own setting
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    previous = configure_vllm_environment(VllmOptions(cpu_threads_bind="0-1"), tmp_path / "mine", "cpu",
                                          separate_process=False)
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path / "mine")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"  # kept: the user's override wins
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    restore_environment(previous)
    assert os.environ["VLLM_RPC_BASE_PATH"] == stale
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
