"""The serving engine with vLLM's shape: SamplingParams, Request, Scheduler, sampler, model runner, LLMEngine, LLM."""
