"""Suite-wide test configuration."""

import os

import torch
from hypothesis import settings

# Tests fork children (kill -9 matrix, fuzz workers, disk-full checks) from a pytest process whose
# earlier tests already ran parallel torch ops. GNU OpenMP is not fork-safe: a parallel op in the
# child (e.g. filling a large tensor) then hangs. DataLoader does the same for its workers.
os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))

# Hypothesis' default deadline (200 ms per example) and its input-generation health check (1 s
# when a deadline is set) are wall-clock limits: on a loaded machine a test that asserts neither
# fails with DeadlineExceeded, Flaky or FailedHealthCheck. Tests bound their time with
# pytest-timeout (setup.cfg) instead; a test's own @settings still overrides these defaults.
settings.register_profile("memtree", deadline=None)
settings.load_profile("memtree")
