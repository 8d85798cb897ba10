"""`python -m harness.kubelet`: run the process-backed nodes (see the package docstring)."""

from harness.kubelet.loop import main

main()
