"""kvlab's layers import downward only: the folder listing is the architecture the course teaches.

Every import in the package is read from the source (lazy ones inside functions too) and checked
against the table below, lowest layer first. A failure names the module, the line and the rule.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvlab"

# What each part of kvlab may import from kvlab itself (besides its own subpackage).
ALLOWED_KVLAB = {
    "kvlab.paths": set(),
    "kvlab.validation": set(),
    "kvlab.quantization": set(),
    "kvlab.core": {"kvlab.validation"},
    # Offloading's bookkeeping runs in the scheduler beside core but needs nothing of it: hashes are opaque keys.
    "kvlab.kv_offload": {"kvlab.validation"},
    # The simulators reuse core's block arithmetic (blocks per sequence), which needs no tensors either.
    "kvlab.analysis": {"kvlab.core", "kvlab.paths", "kvlab.validation"},
    # KV connectors: the scheduler's half hashes blocks as core does and keeps a kv_offload tier, the worker's half
    # copies between the cache's pools and the tier's host pool.
    "kvlab.kv_transfer": {"kvlab.core", "kvlab.kv_offload", "kvlab.cache", "kvlab.validation"},
    "kvlab.model": {"kvlab.paths", "kvlab.validation"},
    "kvlab.kernels": {"kvlab.quantization", "kvlab.validation"},
    "kvlab.cache": {"kvlab.core", "kvlab.model", "kvlab.kernels", "kvlab.quantization", "kvlab.analysis",
                    "kvlab.validation"},
    # LLM.beam_search runs Chapter 5's loop, so the engine sits above the chapters' decoding loops.
    "kvlab.engine": {"kvlab.core", "kvlab.kv_transfer", "kvlab.cache", "kvlab.model", "kvlab.kernels",
                     "kvlab.quantization", "kvlab.analysis", "kvlab.decoding", "kvlab.spec_decode", "kvlab.paths",
                     "kvlab.validation"},
    # Proposers run a draft model on its own paged cache; the engine hands them its sampler.
    "kvlab.spec_decode": {"kvlab.core", "kvlab.cache", "kvlab.model", "kvlab.paths", "kvlab.validation"},
    "kvlab.decoding": {"kvlab.core", "kvlab.cache", "kvlab.model", "kvlab.kernels", "kvlab.quantization",
                       "kvlab.analysis", "kvlab.validation"},
    "kvlab.baselines": {"kvlab.core", "kvlab.cache", "kvlab.model", "kvlab.engine", "kvlab.decoding",
                        "kvlab.analysis", "kvlab.validation"},
    # Measurement (vLLM's vllm/benchmarks): it drives engines and caches; nothing but scripts and notebooks import it.
    # A live chat workload renders its turns with the server's chat template, to keep each within the context.
    "kvlab.benchmarks": {"kvlab.core", "kvlab.cache", "kvlab.model", "kvlab.engine", "kvlab.decoding",
                         "kvlab.baselines", "kvlab.analysis", "kvlab.quantization", "kvlab.paths", "kvlab.validation",
                         "kvlab.entrypoints.openai.chat_template"},
    # Widgets draw plain data: the block views' helpers are all they may read of the package.
    "kvlab.widgets": {"kvlab.core.block_views"},
    # GPU-scale simulation: a step-time model and vLLM's capacity arithmetic, and the engine's own scheduler on a
    # virtual clock above them; it sits on top of the engine, the baselines and the measurements, and nothing
    # in kvlab imports it.
    # It drives a KV connector's scheduler half (the real tier decisions) and times the copies the worker would make,
    # and places requests on simulated replicas with the live router's own policies and index.
    "kvlab.simulation": {"kvlab.core", "kvlab.cache", "kvlab.model", "kvlab.engine", "kvlab.kv_transfer",
                         "kvlab.router", "kvlab.kv_offload", "kvlab.decoding", "kvlab.spec_decode", "kvlab.baselines",
                         "kvlab.benchmarks", "kvlab.analysis", "kvlab.quantization", "kvlab.paths", "kvlab.validation"},
    # The notebooks' checks; Chapter 7's launch a learner's kernel and load kvlab.course.checks afresh by name.
    "kvlab.course": {"kvlab.kernels"},
    # A router's index over replicas' caches reads only the events' schema and the block hashes.
    "kvlab.router": {"kvlab.core", "kvlab.validation"},
    # The HTTP server sits on the engine; nothing below imports it. Its router hashes prompts as the engine does
    # (core) and places them with the router's index and policies.
    "kvlab.entrypoints": {"kvlab.engine", "kvlab.model", "kvlab.core", "kvlab.router", "kvlab.validation"},
    "kvlab.serve": {"kvlab.entrypoints"},
    "kvlab": {"kvlab.engine", "kvlab.model"},  # the public API, imported lazily by __init__
}

# Third-party packages a layer must never import, even lazily.
FORBIDDEN_THIRD_PARTY = {
    "kvlab.core": {"torch", "numpy", "transformers", "triton", "ipywidgets"},
    "kvlab.analysis": {"torch", "transformers", "triton", "ipywidgets"},
    "kvlab.validation": {"torch", "numpy", "transformers", "triton", "ipywidgets"},
    "kvlab.paths": {"torch", "numpy", "transformers", "triton", "ipywidgets"},
    "kvlab.quantization": {"transformers", "triton", "ipywidgets"},
    "kvlab.kernels": {"transformers", "ipywidgets"},
    # Its movers (worker, disk) use torch and safetensors; the bookkeeping modules stay torch-free (see below).
    "kvlab.kv_offload": {"transformers", "triton", "ipywidgets"},
    "kvlab.kv_transfer": {"transformers", "triton", "ipywidgets"},
    "kvlab.model": {"ipywidgets", "triton"},
    "kvlab.cache": {"ipywidgets"},
    "kvlab.engine": {"ipywidgets"},
    "kvlab.spec_decode": {"ipywidgets", "triton"},
    "kvlab.decoding": {"ipywidgets"},
    "kvlab.baselines": {"ipywidgets"},
    # No model runs in a simulation: its clock comes from the step-time model.
    "kvlab.simulation": {"torch", "transformers", "triton", "ipywidgets"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> str:
    """The key of ALLOWED_KVLAB that a kvlab module belongs to (its subpackage, or itself at the top)."""
    parts = name.split(".")
    if len(parts) == 1:
        return "kvlab"
    return ".".join(parts[:2])


def imports_of(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from kvlab.core import block_pool` imports kvlab.core.block_pool.
            found += [(node.lineno, f"{target}.{alias.name}")
                      if (PACKAGE.parent / Path(*f"{target}.{alias.name}".split("."))).with_suffix(".py").exists()
                      or (PACKAGE.parent / Path(*f"{target}.{alias.name}".split("."))).is_dir()
                      else (node.lineno, target) for alias in node.names]
    return found


def allowed(importer: str, imported: str) -> bool:
    layer = layer_of(importer)
    if layer_of(imported) == layer and layer != "kvlab":
        return True
    return any(imported == ok or imported.startswith(ok + ".") for ok in ALLOWED_KVLAB[layer])


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer():
    """A new subpackage or top-level module must be given its place in ALLOWED_KVLAB first."""
    unknown = sorted({layer_of(module_name(p)) for p in MODULES} - set(ALLOWED_KVLAB))
    assert not unknown, f"add these to the layer table in {Path(__file__).name}: {unknown}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down_the_layers(path):
    """Bookkeeping knows no tensors, kernels know no model or engine, and nothing but notebooks knows the widgets."""
    importer = module_name(path)
    layer = layer_of(importer)
    upward, heavy = [], []
    for line, imported in imports_of(path):
        top = imported.split(".")[0]
        if top == "kvlab":
            if not allowed(importer, imported):
                upward.append(f"  line {line}: {imported} (a {layer} module may import: "
                              f"{sorted(ALLOWED_KVLAB[layer]) or 'nothing else in kvlab'})")
        elif top in FORBIDDEN_THIRD_PARTY.get(layer, ()):
            heavy.append(f"  line {line}: {imported} ({layer} must not depend on {top})")
    assert not upward and not heavy, \
        f"{path.relative_to(PACKAGE.parent)} breaks the layering:\n" + "\n".join(upward + heavy)


def test_core_imports_only_the_standard_library():
    """kvlab.core is plain-Python bookkeeping, as vLLM's v1/core: nothing outside the standard library and kvlab."""
    stdlib = sys.stdlib_module_names
    offenders = []
    for path in PACKAGE.joinpath("core").rglob("*.py"):
        for line, imported in imports_of(path):
            top = imported.split(".")[0]
            if top != "kvlab" and top not in stdlib:
                offenders.append(f"{path.name}:{line} imports {imported}")
    assert not offenders, "core must stay torch-free:\n" + "\n".join(offenders)


# kv_offload's scheduler side, which must run where no tensor library is loaded.
KV_OFFLOAD_BOOKKEEPING = (
    "abstract", "mediums", "backend", "policy_manager", "lru_manager", "arc_manager", "cpu", "__init__",
)


def test_kv_offload_bookkeeping_imports_only_the_standard_library():
    """The managers and backends are plain Python like kvlab.core; only worker.py and disk.py may touch tensors."""
    stdlib = sys.stdlib_module_names
    offenders = []
    for name in KV_OFFLOAD_BOOKKEEPING:
        path = PACKAGE / "kv_offload" / f"{name}.py"
        for line, imported in imports_of(path):
            top = imported.split(".")[0]
            if top != "kvlab" and top not in stdlib:
                offenders.append(f"{path.name}:{line} imports {imported}")
    assert not offenders, "kv_offload's bookkeeping must stay torch-free:\n" + "\n".join(offenders)


def test_the_checker_sees_a_planted_upward_import():
    """The rules bite: a core module importing the engine (even lazily) or torch is reported."""
    path = PACKAGE / "core" / "paging.py"
    source = path.read_text() + "\n\ndef _late():\n    from kvlab.engine.scheduler import Scheduler\n    import torch\n"
    found = [name for _, name in imports_of(path, source)]
    assert "kvlab.engine.scheduler" in found and "torch" in found
    assert not allowed("kvlab.core.paging", "kvlab.engine.scheduler")
    assert not allowed("kvlab.engine.llm_engine", "kvlab.widgets.block_map")
    assert not allowed("kvlab.kernels.reference", "kvlab.cache.quantized_cache")
    assert allowed("kvlab.engine.llm_engine", "kvlab.core.kv_cache_manager")


@pytest.mark.parametrize("module,absent", [
    ("kvlab.core.kv_cache_manager", ("torch", "numpy", "transformers")),
    ("kvlab.analysis.memory_sim", ("torch", "transformers")),
    ("kvlab.quantization", ("transformers", "triton")),
    ("kvlab.kernels", ("transformers", "kvlab.cache", "kvlab.engine", "kvlab.model")),
    ("kvlab.analysis.vllm_bridge", ("kvlab.simulation",)),
    ("kvlab.kv_offload", ("torch", "numpy", "safetensors")),
    ("kvlab.kv_offload.arc_manager", ("torch", "numpy", "safetensors")),
])
def test_importing_a_layer_loads_nothing_above_it(module, absent):
    """The same rule at run time, in a fresh interpreter: what a module pulls in, transitively."""
    import subprocess

    code = f"import sys, {module}; print(' '.join(m for m in {absent!r} if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not run.stdout.strip(), f"importing {module} also imported {run.stdout.strip()}"
