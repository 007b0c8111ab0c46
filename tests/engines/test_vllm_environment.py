"""The vLLM engine's environment variables: its own ipc directory always wins over an inherited one,
and closing puts the process's environment back (child processes must not inherit a removed dir);
its start-up's temp files go to its scratch dir, and the process's temp dir is the same after.

Runs without vLLM installed: only the environment handling is exercised here; the engine itself is
in test_vllm_engine.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from streamrl.engines.options import VllmOptions
from streamrl.engines.vllm_engine import configure_vllm_environment, restore_environment, temp_files_in


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


def test_start_up_temp_files_go_to_the_scratch_dir_and_the_temp_dir_is_restored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "users"))
    (tmp_path / "users").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # as in a process that has not looked it up yet
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with temp_files_in(scratch):
        assert tempfile.gettempdir() == str(scratch)
        child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                               capture_output=True, text=True, timeout=60, check=True)
        assert child.stdout.strip() == str(scratch)  # a spawned engine core's too
    assert tempfile.gettempdir() == str(tmp_path / "users")
    assert os.environ["TMPDIR"] == str(tmp_path / "users")
