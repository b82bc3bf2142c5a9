"""Cluster measurements for the planner: `partrain bench comm`.

Modules: profile (the communication profile file: read, write, check, bandwidths for the planner;
pure Python), launch (settings, torchrun command and terminal report of `partrain bench comm`; no
torch), comm (the worker: times collectives with torch.distributed, nccl-tests style).

Importing this package imports nothing heavy: the planner and the validator read profiles without torch.
"""
