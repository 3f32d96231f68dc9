"""Where Chapter 7's kernels run: compiled for a GPU, or in Triton's interpreter on CPU tensors.

@triton.jit decides, when each decorator runs, which of the two a kernel is, so the switch below must
happen before any kernel module is imported: every module of kvlab.kernels that defines kernels imports
this one first. RUNS_IN_INTERPRETER says which mode they were built in, triton_language_as keeps
triton.language's own helpers in that same mode, and check_mode refuses CPU tensors for compiled kernels.
"""

import contextlib
import os
import sys

import torch

# @triton.jit decides, when each decorator runs, whether the kernel is compiled for a GPU or executed by
# Triton's interpreter on CPU tensors: triton 3.x reads TRITON_INTERPRET (through triton.knobs) at that
# moment, so it must be set before the decorators below, and setting it later changes nothing for them.
# Without CUDA a compiled kernel cannot run at all ("0 active drivers"), so on such a machine we pick
# the interpreter unless the user already chose: TRITON_INTERPRET=0 keeps compiled kernels (what
# kvlab.kernels.aot needs to compile for a GPU that is not here), TRITON_INTERPRET=1 forces the
# interpreter even with CUDA. If triton was imported before this line, its own helpers (tl.sum, ...)
# were built in the other mode: triton_language_as below deals with that.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


@triton.jit
def _probe():
    pass


# True when this process's kernels are built by Triton's interpreter (CPU tensors), False when compiled for a GPU.
RUNS_IN_INTERPRETER = isinstance(_probe, InterpretedFunction)

# triton.language's own helpers (tl.sum, tl.max, tl.zeros, tl.cdiv, ...) are @triton.jit functions too,
# built for the interpreter or the compiler when triton is first imported. When another module imported
# triton before this one switched the interpreter on, they are compiled-mode functions that refuse to run
# in the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel"); the other way round,
# interpreter-mode helpers break an ahead-of-time compile. Their twins of the right kind stand in while
# our kernels run or compile, and the originals are put back afterwards.
_TWINS = {}
# @triton.jit helpers the kernels call by their global names, per module (kvlab.kernels.triton_unified_attention
# registers its own): they must be built in the same mode as the kernel that calls them.
DEVICE_FUNCTIONS: dict[str, tuple[str, ...]] = {}


def register_device_functions(module_name: str, names: tuple[str, ...]) -> None:
    """Let triton_language_as swap these @triton.jit helpers of module_name with the kernels."""
    DEVICE_FUNCTIONS[module_name] = tuple(names)


def _twin(helper, interpreted: bool):
    key = (helper.fn, interpreted)
    if key not in _TWINS:  # one twin per function, so Triton's identity checks (combine_fn is _sum_combine) hold
        _TWINS[key] = InterpretedFunction(helper.fn) if interpreted else JITFunction(helper.fn, **helper.kwargs)
    return _TWINS[key]


@contextlib.contextmanager
def triton_language_as(interpreted: bool):
    """Within the block, triton.language's @jit helpers are built for the interpreter (True) or the compiler (False)."""
    wrong = JITFunction if interpreted else InterpretedFunction
    swapped = []
    if isinstance(tl.sum, wrong):
        spaces = [module for name, module in list(sys.modules.items()) if name.startswith("triton.language")]
        for space in spaces + [tl.core.tensor]:  # tl.core.tensor holds the method forms, x.sum()
            for name, value in list(vars(space).items()):
                if isinstance(value, wrong) and value.fn.__module__.startswith("triton.language"):
                    swapped.append((space, name, value))
                    setattr(space, name, _twin(value, interpreted))
    # Our own device functions are called from the kernels by their global names: they must match the mode too.
    for module_name, names in DEVICE_FUNCTIONS.items():
        module = sys.modules[module_name]
        for name in names:
            value = getattr(module, name)
            if isinstance(value, wrong):
                swapped.append((module, name, value))
                setattr(module, name, _twin(value, interpreted))
    try:
        yield
    finally:
        for space, name, value in reversed(swapped):
            setattr(space, name, value)


def check_mode(device: torch.device) -> None:
    """Refuse CPU tensors when the kernels were compiled for a GPU (the interpreter was off at import)."""
    if device.type == "cpu" and not RUNS_IN_INTERPRETER:
        raise RuntimeError(
            "kvlab.kernels was imported with Triton's interpreter off (TRITON_INTERPRET=0, or CUDA was available), "
            "so its kernels are compiled for a GPU and cannot read CPU tensors. Move the tensors to CUDA, or set "
            "TRITON_INTERPRET=1 before importing kvlab.kernels (in a new process) to run them on the CPU.")
