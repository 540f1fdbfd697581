"""Benchmarks that print JSON. They import the programs at the checkout's root, so they run from there as
modules: `python -m bench.learning --help`."""
