"""Shared test set-up: one reproducible hypothesis profile, float64 references, small helpers."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

# derandomize: the same examples on every run, so that CI is reproducible and a failure seen
# once is seen again. deadline=None: torch's first call of an op can be slow on a busy runner.
settings.register_profile(
    "klpen",
    deadline=None,
    derandomize=True,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "klpen"))

# Two cores shared by every job: torch's own thread pool would only oversubscribe them.
torch.set_num_threads(1)
