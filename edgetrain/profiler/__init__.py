"""Profiling a training step (what edgetrain profile runs, one method per fresh process) and the
benchmark protocol the tools/bench_*.py scripts share (bench.py)."""
