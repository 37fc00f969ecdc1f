"""The model runner: a scheduled step in, tokens out.

`inputs` builds a step's host tables (pure, no MLX graph), `execution` runs the forward
(with the step built ahead and a pipeline's submit/finish), `verification` samples,
accepts drafts and rewinds recurrent state. Imports the kv, models and kernels layers.
"""

from macinfer.engine.runner.execution import ModelRunner, StepResult, Submitted

__all__ = ["ModelRunner", "StepResult", "Submitted"]
