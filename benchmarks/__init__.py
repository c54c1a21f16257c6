"""Transformer Anatomy's timing suite: ``benchmarks/run.py`` is the entry point, its docstring the overview."""
