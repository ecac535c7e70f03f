"""Tools that drive the whole stack (a Generator, the engine) from above it: ``speculant.load`` and
its ``--dtype auto`` measurement on a CPU, layerskip tuning, self-distillation and the training driver
of ``speculant train``. Nothing below this package imports it."""
