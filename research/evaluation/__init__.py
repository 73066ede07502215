"""Evaluation: the loss of a model on batches with bootstrap intervals (evaluate, bootstrap),
length extrapolation of a run's checkpoint in every mode and scaling (extrapolation), the run's
eval.json (results) and text generation from a run (generate)."""
