"""K/V tensors and the attention that reads them (vLLM's worker-side KV cache): naive, paged, quantized, swap space."""
