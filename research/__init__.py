"""Measuring scripts that only the developers run (not installed).

Run them from the repository root: ``python -m research.<name>``."""
