"""Quantized weight formats: how checkpoints store them and their reference arithmetic."""
