"""The five systems bench/run.py compares, one module and one phase each:
how to start it as a process under test, and what to record of its drain."""
