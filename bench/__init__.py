"""CPU benchmarks of recovery time and goodput (`python -m bench`; results in docs/benchmarks.md).

Benchmarks live here, never in timed unit tests: a number only means something next to the exact
command and machine that produced it, and docs/benchmarks.md records both.
"""
