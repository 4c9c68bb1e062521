"""Benchmark scores computed from simulated runs (nuPlan closed-loop score)."""
