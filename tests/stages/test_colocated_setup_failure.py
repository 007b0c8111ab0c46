"""A colocated generate stage whose train stage failed to set up reports that failure, and its
close() (which the worker runs after a failed setup) then finishes without an error of its own.
Seen on a GPU: close() raised AttributeError ('engine') and hid the train stage's error."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from streamrl.stages.colocated import ColocatedSetupError, colocated_rank
from streamrl.stages.generate import GenerateStage


def test_close_after_a_failed_colocated_setup_is_clean() -> None:
    ctx = SimpleNamespace(spec=SimpleNamespace(name="generate", colocate_with="train", weights_from=None), shared={},
                          options={}, pipeline=SimpleNamespace(placement="colocated"),
                          config=SimpleNamespace(resources=SimpleNamespace(start_timeout_s=5.0)))

    async def main() -> None:
        shared = colocated_rank(ctx)  # type: ignore[arg-type]
        shared.error = "RuntimeError: boom"
        shared.ready.set()  # the train stage gave up: no policy, no groups
        stage = GenerateStage()
        with pytest.raises(ColocatedSetupError, match="failed to set up: RuntimeError: boom"):
            await stage.setup(ctx)  # type: ignore[arg-type]
        await stage.close()
        assert shared.generation_closed.is_set()

    anyio.run(main)
