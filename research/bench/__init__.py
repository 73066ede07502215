"""Benchmark suites as library code; `python -m experiments.bench` runs them.

  timing.py   warm-up + block_until_ready + median; compiled memory analysis
  mixers.py   mixer kernels, forward + backward: time and temp memory against length
  decode.py   per-token decode latency and cache bytes against context length
  report.py   the Suite interface and its outputs: JSON rows, markdown tables, PNG curves
  peers.py    the project against PyTorch on the same CPU (peers_torch.py: the PyTorch side,
              an optional extra: requirements-peers.txt)
"""
