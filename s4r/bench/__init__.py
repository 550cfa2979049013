"""Benchmarks for s4r: RULER-style accuracy tasks and their scoring."""
