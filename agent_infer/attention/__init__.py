"""Attention backends (a protocol and a registry by cache layout and device) and the
per-step attention metadata they read."""
