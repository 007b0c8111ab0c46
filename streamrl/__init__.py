"""streamrl: RL training of language models as a streaming dataflow over a ZeroMQ transfer dock.

    import streamrl
    result = streamrl.run("configs/grpo_digits.yaml", ["algo.steps=50"])
    result = await streamrl.arun(config)
    result = streamrl.run(resume="runs/grpo_digits-<timestamp>")   # continue from its newest checkpoint
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from streamrl.runtime.launcher import RunResult


def run(config: Any = None, overrides: list[str] | None = None, **kwargs: Any) -> RunResult:
    """Run a config (path, dict or RunConfig) to completion; returns the metrics and outputs.
    ``resume=RUN_DIR`` continues that run from its newest checkpoint (config: its own)."""
    from streamrl.runtime.launcher import run as _run

    return _run(config, overrides, **kwargs)


async def arun(config: Any = None, overrides: list[str] | None = None, **kwargs: Any) -> RunResult:
    from streamrl.runtime.launcher import arun as _arun

    return await _arun(config, overrides, **kwargs)


__all__ = ["__version__", "arun", "run"]
