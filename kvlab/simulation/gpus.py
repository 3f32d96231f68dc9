"""The GPUs a deployment can be planned on: memory, memory bandwidth, dense tensor FLOP/s and the link between GPUs.

Every figure is the vendor's datasheet figure, named in the GPU's `source`. Datasheet peaks are not reached by
real kernels; how far below them each kind of operator runs is the step-time model's business
(kvlab.simulation.step_time.EFFICIENCY), not this table's.

Memory: NVIDIA's "80GB" is binary (80 GiB of HBM), so `memory_bytes` is the datasheet figure in GiB. The driver
reports less, because of what it reserves (and ECC on GDDR6): about 79 GiB of an A100-80GB, 140 GiB of an H200,
22.5 GiB of an L4, 15 GiB of a T4. vLLM sizes its pool from the reported total, so kvlab's capacity from the
datasheet is an upper estimate by that margin; kv_capacity(..., gpu_memory_bytes=...) takes a measured total.

Tensor parallelism: `link_bytes_per_s` is the bandwidth ONE direction of one GPU's link to its peers (NVLink's
datasheet figure is the sum of both directions, so it is halved here); PCIe cards (L4, T4) talk over PCIe.
"""

from dataclasses import dataclass

GiB = 1024 ** 3


@dataclass(frozen=True, slots=True)
class GPU:
    """One GPU model's datasheet figures."""

    name: str
    memory_bytes: int           # HBM (or GDDR) capacity
    memory_bytes_per_s: float   # peak memory bandwidth
    flops_per_s: float          # dense fp16/bf16 tensor-core peak (no sparsity)
    link_bytes_per_s: float     # one direction, per GPU, to its tensor-parallel peers
    link: str                   # NVLink or PCIe, as the datasheet names it
    bf16: bool                  # whether the tensor cores take bfloat16 (T4 does not: vLLM runs bf16 models in fp16)
    source: str                 # the datasheet every figure above comes from

    @property
    def ridge_flops_per_byte(self) -> float:
        """The arithmetic intensity (FLOPs per byte) above which an operator is bound by compute, not memory."""
        return self.flops_per_s / self.memory_bytes_per_s


GPUS = {
    gpu.name: gpu for gpu in (
        GPU("A100-40GB", 40 * GiB, 1555e9, 312e12, 300e9, "NVLink 3, 600 GB/s", True,
            "NVIDIA A100 Tensor Core GPU datasheet (2021, nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
            "A100 40GB SXM: 1,555 GB/s, FP16/BF16 tensor 312 TFLOPS (624 with sparsity), NVLink 600 GB/s"),
        GPU("A100-80GB", 80 * GiB, 2039e9, 312e12, 300e9, "NVLink 3, 600 GB/s", True,
            "NVIDIA A100 Tensor Core GPU datasheet (2021, nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), "
            "A100 80GB SXM: 2,039 GB/s, FP16/BF16 tensor 312 TFLOPS (624 with sparsity), NVLink 600 GB/s"),
        GPU("H100-SXM", 80 * GiB, 3.35e12, 989e12, 450e9, "NVLink 4, 900 GB/s", True,
            "NVIDIA H100 Tensor Core GPU datasheet (2023, h100-datasheet-2430615), H100 SXM: 80 GB, 3.35 TB/s, "
            "FP16/BF16 tensor 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s"),
        GPU("H200", 141 * GiB, 4.8e12, 989e12, 450e9, "NVLink 4, 900 GB/s", True,
            "NVIDIA H200 Tensor Core GPU datasheet (2024, h200-datasheet-3002446), H200 SXM: 141 GB HBM3e, "
            "4.8 TB/s, FP16/BF16 tensor 1,979 TFLOPS with sparsity (989 dense), NVLink 900 GB/s"),
        GPU("L4", 24 * GiB, 300e9, 121e12, 32e9, "PCIe Gen4 x16, 64 GB/s", True,
            "NVIDIA L4 Tensor Core GPU datasheet (2023, l4-datasheet-2595652): 24 GB GDDR6, 300 GB/s, "
            "FP16/BF16 tensor 242 TFLOPS with sparsity (121 dense), PCIe Gen4 x16 64 GB/s, no NVLink"),
        GPU("T4", 16 * GiB, 320e9, 65e12, 16e9, "PCIe Gen3 x16, 32 GB/s", False,
            "NVIDIA T4 Tensor Core GPU datasheet (2019, t4-tensor-core-datasheet-951643): 16 GB GDDR6, "
            "320+ GB/s, mixed-precision FP16/FP32 tensor 65 TFLOPS (no BF16), PCIe Gen3 x16 32 GB/s, no NVLink"),
    )
}


def get_gpu(gpu) -> GPU:
    """A GPU from its name in GPUS (case-insensitive), or the GPU itself."""
    if isinstance(gpu, GPU):
        return gpu
    if isinstance(gpu, str):
        for name, spec in GPUS.items():
            if name.lower() == gpu.lower():
                return spec
    raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)} (or pass a kvlab.simulation.GPU)")
