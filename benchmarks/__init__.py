"""batchgen's benchmarks: the workloads of BENCHMARKS.md, their peers and the engine runs.

Run from the repository root: `PYTHONPATH=src python3 -m benchmarks` lists one entry point
per workload (`python3 -m benchmarks w1 --out DIR`, ...), and every module runs on its own
too (`python3 -m benchmarks.throughput --help`). RESULTS.md holds today's figures,
HISTORY.md every session's.

workloads.py   the workloads' models and requests
engine_runs.py timed engine runs, their options, counters and step phases
moe_runs.py    the 512x128 run W4 and W6 share
precision.py   memory and tok/s by precision (precision_runs.py: its runs, closeness)
peers.py       the transformers peers
profiles.py    where a step's time goes
card.py        the card's ceilings, measured, and timing on it
"""
