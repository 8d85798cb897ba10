"""CPU benchmarks of recovery time and goodput (`python -m bench`; results in docs/benchmarks.md).

Benchmarks live here, never in timed unit tests: a number only means something next to the exact
command and machine that produced it, and docs/benchmarks.md records both.
"""

import sys
from pathlib import Path

# The benchmarks on Kubernetes run on the test harness's cluster (tests/harness: the control
# plane, process-backed nodes, the pieces bench.simnodes borrows): `import harness` works from
# every bench module.
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
