"""How kvlab measures, in one place (vLLM's vllm/benchmarks/): each definition once, used by the chapters, the
scripts in benchmarks/ and the tests.

    latency      TTFT, TPOT, ITL and end-to-end latency from a request's timestamps; percentiles; the knee of a
                 latency curve; choosing a token budget for an SLO
    datasets     request traces scaled to a model's context, prompts cut from a text, Poisson arrivals
    replay       a request stream replayed on a real engine over a virtual clock of measured steps
    queueing     utilisation, Little's law and the M/M/1-style waiting time, beside a measured load ramp
    step_timing  time per generated token, with a cache and without
    block_size   the block-size sweep's cost side: block-table reads and decode time per token
    quantization capacity of 8-bit KV caches, and what quantising costs the logits and perplexity
    step_cost    a forward pass's time against the tokens it carries, fitted as a + b·T
    determinism  why two greedy runs can differ: reduction order, near-ties, batch-invariant decoding
"""
