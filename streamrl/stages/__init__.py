"""streamrl.stages: the built-in pipeline stages and how a policy version reaches generation.

Stages: source, generate, score, reference, advantage, train and eval (one module each). The
placements' weight paths: :mod:`~streamrl.stages.handover` (the trainer's side, every placement),
:mod:`~streamrl.stages.weight_source` (generation's side, every placement; the generate and the agent
stage), :mod:`~streamrl.stages.colocated` (what one colocated process's two stages share) and
:mod:`~streamrl.stages.tp_generation` (tensor-parallel generation groups).
"""
