"""The engine core in a process of its own, and the front ends' side of it.

`engine_core` is the core's loop around an LLMEngine, `process` starts it as a child
process, `client` is what a front end talks to it with, `protocol` the messages between
them, `metrics` the server's Prometheus metrics (kept by the core), and `watch` how each
side learns at once that the other's process is gone.
"""
