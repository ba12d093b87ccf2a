"""Shared test set-up: a reproducible hypothesis profile.

The suite runs at torch's default thread count (what users run; ``make test`` sets
``OMP_NUM_THREADS=2``).

``HYPOTHESIS_PROFILE=thorough`` runs ten times the examples, randomised, for a deeper local run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# derandomize: the same examples on every run, so that CI is reproducible and a failure seen
# once is seen again; no example database, so that nothing from an earlier run is replayed.
# deadline=None: torch's first call of an op can be slow on a busy runner.
settings.register_profile(
    "klpen",
    deadline=None,
    derandomize=True,
    database=None,
    max_examples=30,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("klpen"),
    derandomize=False,
    max_examples=300,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "klpen"))
