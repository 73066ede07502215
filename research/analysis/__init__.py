"""Analyses of trained runs: attention maps, induction heads, head importance and pruning,
explanation by permutation and MHA -> GQA uptraining (analyze), the head measures they use
(heads) and their figures (plots)."""
