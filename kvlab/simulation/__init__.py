"""Serving at GPU scale without a GPU: a step-time model of a real LLM on a real GPU, and the KV capacity of a
deployment by vLLM's start-up arithmetic.

    gpus        datasheet figures of A100-40GB/80GB, H100 SXM, H200, L4 and T4, each with its source
    step_time   ModelSpec from a Hugging Face config; the roofline time of one ragged step, operator by operator
    profiles    the model against Vidur's measured operator and all-reduce times (assets/gpu_profiles)
    capacity    KV blocks and tokens of a deployment: GPU, tensor parallelism, gpu_memory_utilization, KV dtype
    engine      kvlab's own Scheduler and KVCacheManager over a runner that runs no model, on a virtual clock of
                step times (simulate: a trace through paging, Orca's reservations or static batching; a CPU tier
                and a disk tier through the real OffloadingConnector with kv_offloading_size and kv_disk_size)
    offload     the offloading connector's copies on that clock: PCIe links and an NVMe drive per GPU, async
                loads, saves beside the forward pass, disk writes reported when their virtual write ends
    planning    capacity planning on the simulated engine: a step's roofline, the highest rate under a TTFT/TPOT
                SLO (bisection over simulations), the fewest GPUs (replicas x tensor-parallel degree) for a rate
    routing     N replicas of the simulated engine on one clock behind a router policy of kvlab.router.policies (the
                live router's), precise-prefix and kv-cost fed by the replicas' own KV-cache events: hit rate, TTFT,
                load imbalance and SLO attainment per policy, the rate at which each stops meeting an SLO, and a
                hot prefix that pure affinity piles on one replica; policy_grid and weight_sweep give a plot's rows
"""

from kvlab.simulation.capacity import activation_peak_bytes, kv_capacity
from kvlab.simulation.engine import (
                                     GPUStepTime,
                                     SimRequest,
                                     SimulatedEngine,
                                     SimulatedModelRunner,
                                     SimulationResult,
                                     StepComposition,
                                     run_static,
                                     simulate,
)
from kvlab.simulation.gpus import GPU, GPUS, get_gpu
from kvlab.simulation.routing import (
                                      RoutingResult,
                                      hot_prefix_requests,
                                      max_rate_scale_under_slo,
                                      mooncake_requests,
                                      policy_grid,
                                      simulate_routing,
                                      weight_sweep,
)
from kvlab.simulation.step_time import ModelSpec, StepTime, step_time, weight_bytes_per_gpu

__all__ = ["GPU", "GPUS", "GPUStepTime", "ModelSpec", "RoutingResult", "SimRequest", "SimulatedEngine",
           "SimulatedModelRunner", "SimulationResult", "StepComposition", "StepTime", "activation_peak_bytes",
           "get_gpu", "hot_prefix_requests", "kv_capacity", "max_rate_scale_under_slo", "mooncake_requests",
           "policy_grid", "run_static", "simulate", "simulate_routing", "step_time", "weight_bytes_per_gpu",
           "weight_sweep"]
