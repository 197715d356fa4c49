"""Suite-wide test configuration."""

import os

import torch

# Tests fork children (kill -9 matrix, fuzz workers, disk-full checks) from a pytest process whose
# earlier tests already ran parallel torch ops. GNU OpenMP is not fork-safe: a parallel op in the
# child (e.g. filling a large tensor) then hangs. DataLoader does the same for its workers.
os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))
