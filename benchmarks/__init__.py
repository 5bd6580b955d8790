"""batchgen's benchmarks: the workloads of BENCHMARKS.md, their peers and the engine runs.

Run from the repository root, e.g. `PYTHONPATH=src python3 -m benchmarks.throughput --out
DIR` (W1); RESULTS.md lists today's figures and the command of each workload.
"""
