"""Analyses of what a trained run's heads do, from its checkpoints (python -m experiments.analyze),
by name. Each is one file (a subclass of research.analysis.base.Analysis) and one line below:

  attention_maps   attention probabilities of every layer x head, attention mass by distance
  induction        induction, previous-token and in-context-learning scores over training
  head_importance  head importance I_h = E |dL/dxi_h| and iterative pruning (arXiv:1905.10650)
  explanation      attention as explanation: tau against gradient x input, permuted attention
  uptraining       perplexity against decode-cache bytes: scratch, converted, uptrained GQA

Each writes RUN/analysis/<name>/ (figures, a tidy CSV, summary.md); over a sweep, every finished
run's, then DIR/analysis/<name>/ compares the runs (research/analysis/analyze.py). Everything is
computed with the xla softmax backend (the same function as the others, to rounding) in float32
probabilities (research.model.attention.core.probabilities). The measures are
research.analysis.heads, the figures research.analysis.plots.
"""

from research.analysis.attention_maps import AttentionMaps
from research.analysis.explanation import Explanation
from research.analysis.head_importance import HeadImportance
from research.analysis.induction import Induction
from research.analysis.uptraining import Uptraining
from research.model.registry import Registry

REGISTRY = Registry("analysis", "--analysis")
REGISTRY.register(AttentionMaps.name, AttentionMaps)
REGISTRY.register(Induction.name, Induction)
REGISTRY.register(HeadImportance.name, HeadImportance)
REGISTRY.register(Explanation.name, Explanation)
REGISTRY.register(Uptraining.name, Uptraining)
