"""K/V tensors and the attention that reads them (vLLM's worker-side KV cache).

naive, paged (a storage format x a decode backend), quantized, swap space.
"""
