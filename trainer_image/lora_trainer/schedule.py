"""Learning-rate schedule and optimizer from `training`: AdamW, linear warmup, then cosine/linear/constant.

Pure functions of the config, so the progress line's learning rate and the optimizer's are
the same function of the step.
"""

from __future__ import annotations

import optax

from lora_trainer.config import TrainingSpec


def learning_rate_schedule(t: TrainingSpec) -> optax.Schedule:
    """Warmup from 0 to `learningRate` over `warmupSteps`, then decay to 0 at `steps` (or stay, for constant)."""
    warmup = min(t.warmup_steps, t.steps)
    rest = max(t.steps - warmup, 1)
    if t.schedule == "cosine":
        decay = optax.cosine_decay_schedule(t.learning_rate, rest)
    elif t.schedule == "linear":
        decay = optax.linear_schedule(t.learning_rate, 0.0, rest)
    else:
        decay = optax.constant_schedule(t.learning_rate)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, t.learning_rate, warmup), decay], [warmup])


def optimizer(t: TrainingSpec) -> optax.GradientTransformation:
    """AdamW on the LoRA params with the schedule above (gradient accumulation is the trainer's MultiSteps)."""
    return optax.adamw(learning_rate_schedule(t), weight_decay=t.weight_decay)
