"""Benchmark scores and result formats for simulated runs (nuPlan closed-loop score, Leaderboard 2.0 records)."""
