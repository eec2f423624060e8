"""Benchmarks that write their tables to experiments/results/; run each from the repository's root
as a module, `python -m experiments.NAME`, so they import the package, `experiments.common` and the
user models of `tests/` without any path set by hand."""
