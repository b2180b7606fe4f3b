"""Benchmarks: `python -m bench [--quick] [--scenarios 1,2,3,4] [--engine vllm|transformers]`.

Each scenario runs the compared systems in one run, on the same workload, and reports ratios and
whether the issue's targets are met. Results: bench/results/<timestamp>.json, latest.json,
latest.md and latest.png.
"""
