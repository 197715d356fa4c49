"""Suite-wide test configuration."""

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# Tests fork children (kill -9 matrix, fuzz workers, disk-full checks) from a pytest process whose
# earlier tests already ran parallel torch ops. GNU OpenMP is not fork-safe: a parallel op in the
# child (e.g. filling a large tensor) then hangs. DataLoader does the same for its workers.
os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))



def _torch_switches() -> tuple[object, ...]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.get_default_dtype(),
    )


#: torch's process-wide switches as the suite starts.
_SWITCHES = _torch_switches()


@pytest.fixture(autouse=True)
def _torch_switches_restored() -> Iterator[None]:
    """Give back torch's process-wide switches after each test (also one that a module-scoped
    fixture changed), so that no test depends on the order of the suite: Lightning's
    ``Trainer(deterministic=True)`` turns deterministic algorithms on for the whole process, and
    a later test that builds a ``bits8`` tensor then failed (test_torchsave_values failed only
    after test_integration_lightning)."""
    yield
    if _torch_switches() != _SWITCHES:
        deterministic, warn_only, dtype = _SWITCHES
        torch.use_deterministic_algorithms(bool(deterministic), warn_only=bool(warn_only))
        torch.set_default_dtype(dtype)  # type: ignore[arg-type]


# Hypothesis' default deadline (200 ms per example) and its input-generation health check (1 s
# when a deadline is set) are wall-clock limits: on a loaded machine a test that asserts neither
# fails with DeadlineExceeded, Flaky or FailedHealthCheck. Tests bound their time with
# pytest-timeout (setup.cfg) instead; a test's own @settings still overrides these defaults.
settings.register_profile("memtree", deadline=None)
settings.load_profile("memtree")
