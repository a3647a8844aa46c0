"""Benchmarks and measuring tools (not part of the installed product). Run them from the repository root as modules,
`python -m bench.full_e2e ...`, so that the working directory puts the repository on the import path; no install is
needed on the GPU machine."""
