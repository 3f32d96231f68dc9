"""Torch-free sizing and simulation: KV bytes per token, contiguous reservations, request traces,
vLLM's block arithmetic."""
