"""Benchmarks: side by side in one run, with ratios."""
