"""loraplex's benchmark suite: scripts run as `python -m benchmarks.NAME` from the
repository root, sharing `benchmarks.harness` (see its docstring). Figures: RESULTS.md;
history: LOG.md; one GPU session: gpu_session.sh."""
