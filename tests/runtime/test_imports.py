"""The pipeline file format knows nothing of the built-in stages or the tasks: importing
``streamrl.runtime.pipeline`` imports neither, and the stages, the tasks and the pipeline each
import first in a fresh interpreter (no import circle between them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # a fresh interpreter may import torch + transformers (slow on busy cores)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=REPO, env=env)


def test_the_pipeline_module_imports_no_stage_and_no_task() -> None:
    proc = _python("import streamrl.runtime.pipeline; import sys; "
                   "print(sorted(m for m in sys.modules if m.startswith(('streamrl.stages', 'streamrl.tasks'))))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_each_imports_first_in_a_fresh_interpreter() -> None:
    """One fresh interpreter per module that goes first, all at once (each is seconds of imports)."""
    modules = ("streamrl.stages.common", "streamrl.tasks", "streamrl.runtime.pipeline", "streamrl.runtime.prerun")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {first: subprocess.Popen([sys.executable, "-c", "; ".join(
        f"import {m}" for m in (first, *(m for m in modules if m != first)))], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, cwd=REPO, env=env) for first in modules}
    try:
        failed = {first: proc.communicate(timeout=TIMEOUT_S)[1] for first, proc in procs.items()}
        failed = {first: err for first, err in failed.items() if procs[first].returncode != 0}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not failed, failed


def test_the_pipeline_module_has_no_import_of_a_stage_or_a_task_not_even_a_lazy_one() -> None:
    """Statically: no ``import`` anywhere in runtime/pipeline.py (a function's included) names
    ``streamrl.stages`` or ``streamrl.tasks``, so no code path of it can close a circle."""
    import ast

    tree = ast.parse((REPO / "streamrl" / "runtime" / "pipeline.py").read_text())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("streamrl.stages", "streamrl.tasks"))], names


def test_the_launchers_checks_import_no_model_code() -> None:
    """``streamrl run`` checks a config and its pipeline (the stage classes, the tokenizer, the
    task) before any worker starts, while the workers' forkserver imports the model code: the
    checks import none of it (transformers' models, torch.distributed's FSDP and DTensor), which
    took seconds of the launcher's start-up on 2 cores."""
    proc = _python("import sys; from streamrl.config import load_config; "
                   "from streamrl.runtime.prerun import load_pipeline, resolve_run_length; "
                   "load_pipeline(resolve_run_length(load_config('configs/grpo_digits.yaml'))); "
                   "print(sorted(m for m in ('transformers.modeling_utils', 'torch.distributed.fsdp', "
                   "'torch.distributed.tensor', 'streamrl.models.build', 'streamrl.engines.fsdp') if m in sys.modules))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_forkserver_starts_before_any_heavy_import() -> None:
    """``streamrl run`` starts the workers' forkserver before it imports the launcher: its module
    imports neither torch nor the rest of streamrl, and every module it preloads exists (the
    forkserver skips one that does not import, silently)."""
    proc = _python("import sys, importlib.util; import streamrl.runtime.forkserver as f; "
                   "print(sorted(m for m in sys.modules if m.startswith(('torch', 'transformers', 'streamrl.'))), "
                   "[m for m in f.PRELOAD if importlib.util.find_spec(m) is None])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['streamrl.runtime', 'streamrl.runtime.forkserver'] []", proc.stdout
