"""Builders of local test and benchmark checkpoints (random weights, real Qwen2-VL architecture).

Outside the product packages: no service imports them. Tests, benchmarks, `make demo` and the dev
overlay's init containers do (no model hub is reachable, so checkpoints are built, never downloaded).
"""
