"""Torch-free facts that the runtime builds from and the planner counts from: each fact is stated here once."""
