"""streamrl.stages: the built-in pipeline stages and how a policy version reaches generation.

Stages: source, generate, score, reference, advantage, train and eval (one module each). The
placements' weight paths: :mod:`~streamrl.stages.handover` (the trainer's side, every placement),
:mod:`~streamrl.stages.colocated`, :mod:`~streamrl.stages.disaggregated` and
:mod:`~streamrl.stages.tp_generation` (tensor-parallel generation groups).
"""
