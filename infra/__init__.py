"""Infrastructure: the run directory (rundir) and per-rank tracing (tracing)."""
