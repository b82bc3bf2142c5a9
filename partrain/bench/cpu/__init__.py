"""The CPU host model's measurements (`partrain bench compute` on a CPU device): what a training
process's cores do besides kernels (host_costs.py: the profile's "host" block) and the profiled
layout's real rank steps, every rank of a node at once (rank_steps.py: "host.rank_steps").

Frozen with the planner's side (partrain/blueprint/planner/cpu_host.py): it matters only where ranks
are CPU processes sharing cores, and it stores measurements only (the planner derives the rest).
"""
