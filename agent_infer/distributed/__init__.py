"""Tensor and expert parallelism below the model: the rank state and collectives, process
groups, symmetric-memory all-reduce, the control channel and the worker processes."""
