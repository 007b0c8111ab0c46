"""Train stages whose set-up fails on purpose, for tests of how a run fails and cleans up.

Validation refuses every set-up error it can know about before anything starts (see
tests/test_bad_configs.py), so a test of a worker failing *during* set-up needs a failure no
check can predict: these fail right before joining the torch.distributed world, where the real
stages' own set-up errors (a device that vanished, a bad checkpoint) would surface.
"""

from __future__ import annotations

from streamrl.stages.train import TrainStage

MESSAGE = "set-up failed on purpose before joining the world"


class SetupFailsTrain(TrainStage):
    def _world_size(self) -> int:  # called in TrainStage.setup, before the rendezvous
        raise ValueError(f"{MESSAGE} (train worker {self.ctx.worker})")
