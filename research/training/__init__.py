"""Training: the one sharded loop (loop), the checks before any work (checks), starting from
another run's parameters (init_from) and the metrics it logs (metrics). The run directory it
writes is research.runs."""
