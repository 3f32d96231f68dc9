"""One configuration for every entry point: LLM, LLMEngine and `kvlab serve` read the same knobs (vLLM's VllmConfig).

    config = EngineConfig.from_kwargs(block_size=16, num_blocks=256, max_num_seqs=8, kv_cache_dtype="int8")
    config.cache_config.block_size, config.scheduler_config.max_num_seqs        # (16, 8)

The knobs live in four parts, as vLLM's do: ModelConfig (which model, its dtype and device, the
longest sequence, the seed), CacheConfig (block size, pool size, storage format, prefix caching, the
CPU pool for swapping, the attention backend), SchedulerConfig (batch limits, preemption, the paper's
reservation baselines) and SpeculativeConfig (kvlab.spec_decode.config), with kv_transfer_config (a KV
connector, kvlab.kv_transfer) and kv_events_config (KV-cache events, kvlab.engine.kv_events) beside them.
Each knob is declared once, below, with its default, its check and its help text: `LLM(**knobs)` and
`LLMEngine(model, **knobs)` take them as keyword arguments, and `kvlab serve` derives one flag per knob from the same
declaration, in vLLM's spelling (`max_num_seqs` is `--max-num-seqs`).

What needs the model (max_model_len against its context, the pool's size in blocks) is settled when
an engine is built (kvlab.engine.kv_cache_utils), as vLLM sizes its pool after loading the model.
"""

import argparse
import json
import os
import re
import warnings
from dataclasses import dataclass, field, fields, replace

import torch

from kvlab.analysis.contiguous import ARENAS as RESERVATION_ARENAS
from kvlab.analysis.contiguous import POLICIES as RESERVATION_POLICIES
from kvlab.cache.attention_backends import ATTENTION_BACKENDS
from kvlab.cache.kv_storage import resolve_kv_cache_dtype
from kvlab.engine.kv_events import KVEventsConfig
from kvlab.kv_transfer.config import KVTransferConfig
from kvlab.spec_decode.config import SpeculativeConfig
from kvlab.validation import check_int, check_positive_int, is_integer

# ----- how a knob is declared -----

BYTE_UNITS = {"": 1, "k": 2**10, "ki": 2**10, "kib": 2**10, "m": 2**20, "mi": 2**20, "mib": 2**20,
              "g": 2**30, "gi": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """A byte count from the command line: 536870912, 512MiB, 512M, 1GiB."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (give e.g. 536870912, 512MiB or 1GiB)")
    return int(match.group(1)) * BYTE_UNITS[match.group(2).lower()]


def parse_json_object(text: str) -> dict:
    """A JSON object from the command line, e.g. '{"method": "ngram", "num_speculative_tokens": 3}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        example = '{"method": "ngram", "num_speculative_tokens": 3}'
        raise argparse.ArgumentTypeError(f"give a JSON object, e.g. '{example}'")
    return value


def knob(default, help: str, check=None, *, choices=None, parse=None, flag: bool = True):
    """A config field declared once: its default, a check (name, value) -> value that raises ValueError on a bad
    value, and the help text and parsing of its command-line flag (flag=False: not on the command line)."""
    return field(default=default, metadata={"help": help, "check": check, "choices": choices, "parse": parse,
                                            "flag": flag})


def _optional(check):
    return lambda name, value: None if value is None else check(name, value)


def _one_of(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    return check


def _boolean(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _hash_seed(name, value):
    # A string, as PYTHONHASHSEED is; an int is taken as its decimal spelling (the same seed either way).
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise ValueError(f"{name} must be a non-empty string such as PYTHONHASHSEED's value, or None, got {value!r}")
    return str(value)


def _kv_cache_memory(name, value):
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer number of bytes, got {value!r}")
    return int(value)


DTYPES = {"auto": torch.float32, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _dtype(name, value):
    """'auto' (float32: the course's CPU default), a name, or a torch dtype; kept as the name (None is 'auto')."""
    if value is None:
        return "auto"
    if isinstance(value, torch.dtype):
        for key, dtype in DTYPES.items():
            if dtype == value and key != "auto":
                return key
    if value in DTYPES:
        return value
    raise ValueError(f"{name} must be one of {', '.join(DTYPES)} (or the torch dtype), got {value!r}")


def _speculative(name, value):
    return None if value is None else SpeculativeConfig.from_dict(value)


def _kv_transfer(name, value):
    """None, or a KVTransferConfig from itself, a dict with vLLM's keys or their JSON."""
    return None if value is None else KVTransferConfig.from_value(value)


def _kv_events(name, value):
    """None, or a KVEventsConfig from itself, a dict with vLLM's keys or their JSON."""
    return None if value is None else KVEventsConfig.from_value(value)


# Knobs that are whole configs of their own, beside the three parts: name -> how a value becomes one.
SUB_CONFIGS = {"speculative_config": _speculative, "kv_transfer_config": _kv_transfer, "kv_events_config": _kv_events}


class _Checked:
    """Runs every field's declared check once, when the config is made; a bad value raises naming the knob."""

    def __post_init__(self):
        for f in fields(self):
            check = f.metadata.get("check")
            if check is not None:
                object.__setattr__(self, f.name, check(f.name, getattr(self, f.name)))
        self._check_together()

    def _check_together(self) -> None:
        """Checks that read more than one knob."""


# ----- the four parts -----

@dataclass(frozen=True, slots=True)
class ModelConfig(_Checked):
    """Which model runs, in what dtype, on which device, for how long a sequence, with which seed."""

    model: object = knob(None, "a Hugging Face id or a local folder (default: the course's embedded model)",
                         flag=False)
    dtype: object = knob("auto", "the model's dtype when kvlab loads it ('auto': float32)", _dtype,
                         choices=tuple(DTYPES))
    device: str | None = knob(None, "cuda or cpu (default: cuda when there is one)")
    max_model_len: int | None = knob(None, "the longest sequence, prompt and output (default: the model's context)",
                                     _optional(check_positive_int), parse=int)
    seed: int = knob(0, "the seed of requests that bring none of their own", lambda n, v: check_int(n, v, 0),
                     parse=int)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True, slots=True)
class CacheConfig(_Checked):
    """The KV cache: block size, the pool's size, its storage format, prefix caching, swap space, attention."""

    block_size: int = knob(16, "tokens per KV block", check_positive_int, parse=int)
    num_blocks: int | None = knob(None, "KV blocks in the pool (vLLM: --num-gpu-blocks-override)",
                                  _optional(check_positive_int), parse=int)
    kv_cache_memory: int | None = knob(None, "the pool as a byte budget instead of --num-blocks, e.g. 512MiB "
                                             "(vLLM: --kv-cache-memory-bytes)", _optional(_kv_cache_memory),
                                       parse=parse_bytes)
    kv_cache_dtype: str = knob("auto", "how K/V are stored: the model's dtype (auto), int8 or fp8 (= fp8_e4m3) with a "
                                       "scale per block and KV head, or int8_per_token_head / fp8_per_token_head "
                                       "with one per token and KV head",
                               lambda n, v: resolve_kv_cache_dtype(v),
                               choices=("auto", "int8", "fp8", "fp8_e4m3", "int8_per_token_head", "fp8_per_token_head"))
    enable_prefix_caching: bool = knob(True, "reuse the K/V of full blocks that earlier prompts computed", _boolean)
    hash_seed: str | None = knob(None, "the root of every block hash (vLLM's NONE_HASH): engines that must name "
                                       "blocks alike (replicas behind a cache-aware router, a disk tier after a "
                                       "restart) share it; kvlab serve defaults to $PYTHONHASHSEED, as vLLM does; "
                                       "unset: kvlab's fixed root", _optional(_hash_seed))
    num_cpu_blocks: int | None = knob(None, "blocks in the CPU pool that swap preemption copies to "
                                            "(default: as many as the device pool)",
                                      _optional(lambda n, v: check_int(n, v, 0)), parse=int)
    attention_backend: str = knob("auto", "how queries read the pool: torch (batched decodes), triton (the unified "
                                          "kernel for the whole step) or auto (triton on a CUDA GPU)",
                                  _one_of(ATTENTION_BACKENDS), choices=ATTENTION_BACKENDS)

    def _check_together(self) -> None:
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_blocks or kv_cache_memory (a byte budget for the pool), not both")

    def cpu_blocks_for(self, num_blocks: int) -> int:
        """Blocks of the CPU pool for swapping: num_cpu_blocks, or as many as the device pool's num_blocks."""
        return num_blocks if self.num_cpu_blocks is None else self.num_cpu_blocks


@dataclass(frozen=True, slots=True)
class SchedulerConfig(_Checked):
    """What one step may hold, and what happens when the pool runs out."""

    max_num_seqs: int = knob(32, "requests running at once, at most", check_positive_int, parse=int)
    max_num_batched_tokens: int = knob(512, "tokens in one step, at most: decodes first, then prompt chunks",
                                       check_positive_int, parse=int)
    preemption_mode: str = knob("recompute", "how a request gives its blocks back when the pool runs out: recompute "
                                             "(vLLM V1's only mode) or swap to the CPU pool (V0's other mode)",
                                _one_of(("recompute", "swap")), choices=("recompute", "swap"))
    reservation_policy: str | None = knob(None, "the paper's Orca baselines: reserve a request's blocks at "
                                                "admission for its max length (max), the next power of two of its "
                                                "real length (pow2) or its real length (oracle); default: paging",
                                          _optional(_one_of(RESERVATION_POLICIES)), choices=RESERVATION_POLICIES)
    reservation_arena: str | None = knob(None, "where an Orca baseline's reservation lives: one contiguous range "
                                               "placed first-fit or by the buddy allocator the paper assumes "
                                               "(admission then also needs a range that fits); default: the pool's "
                                               "blocks, anywhere", _optional(_one_of(RESERVATION_ARENAS)),
                                         choices=RESERVATION_ARENAS)

    disable_hybrid_kv_cache_manager: bool = knob(False, "keep every layer's K/V as if all layers were full "
                                                        "attention (vLLM's flag): a model with sliding-window layers "
                                                        "then gives no block back, and writes the same tokens",
                                                 _boolean)

    def _check_together(self) -> None:
        if self.reservation_arena is not None and self.reservation_policy is None:
            raise ValueError(f"reservation_arena={self.reservation_arena!r} places an Orca baseline's reservations: "
                             f"give reservation_policy too (paging reserves nothing)")


PARTS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig}
# Old keyword -> the knob that replaced it.
RENAMED = {"decode_backend": "attention_backend"}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an engine is built from (vLLM's VllmConfig): the three parts and the speculative config."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None

    @classmethod
    def knob_names(cls) -> dict[str, str]:
        """Every flat knob name -> the part that holds it."""
        names = {f.name: part for part, config in PARTS.items() for f in fields(config)}
        names.update({name: name for name in SUB_CONFIGS})
        return names

    @classmethod
    def from_kwargs(cls, **knobs) -> "EngineConfig":
        """A config from flat keyword arguments (LLM's and LLMEngine's form); an unknown name is a ValueError."""
        for old, new in RENAMED.items():
            if old in knobs:
                if new in knobs:
                    raise ValueError(f"give {new} only: {old} is its old name")
                warnings.warn(f"{old} is now called {new}: the backend also runs prefills", DeprecationWarning,
                              stacklevel=3)
                knobs[new] = knobs.pop(old)
        names = cls.knob_names()
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise ValueError(f"unknown engine setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                             f"kvlab knows {', '.join(names)}")
        parts = {part: {} for part in PARTS}
        for name, value in knobs.items():
            if name not in SUB_CONFIGS:
                parts[names[name]][name] = value
        return cls(**{part: PARTS[part](**values) for part, values in parts.items()},
                   **{name: make(name, knobs.get(name)) for name, make in SUB_CONFIGS.items()})

    def replace(self, **knobs) -> "EngineConfig":
        """A copy with some flat knobs changed (each checked again)."""
        names = self.knob_names()
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise ValueError(f"unknown engine setting {', '.join(unknown)}; kvlab knows {', '.join(names)}")
        changes = {}
        for part in PARTS:
            mine = {k: v for k, v in knobs.items() if names[k] == part}
            if mine:
                changes[part] = replace(getattr(self, part), **mine)
        for name, make in SUB_CONFIGS.items():
            if name in knobs:
                changes[name] = make(name, knobs[name])
        return replace(self, **changes)

    def as_kwargs(self) -> dict:
        """The flat knobs, as from_kwargs takes them."""
        out = {f.name: getattr(getattr(self, part), f.name) for part, config in PARTS.items() for f in fields(config)}
        out["speculative_config"] = self.speculative_config
        out["kv_transfer_config"] = self.kv_transfer_config
        out["kv_events_config"] = self.kv_events_config
        return out

    # ----- the command line -----
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per knob, in vLLM's spelling, with its default, choices and help (the model is positional)."""
        parser.add_argument("model", nargs="?", default=None, help=ModelConfig.__dataclass_fields__["model"]
                            .metadata["help"])
        for part, config in PARTS.items():
            group = parser.add_argument_group(part.replace("_", " "), config.__doc__)
            for f in fields(config):
                meta = f.metadata
                if not meta.get("flag", True):
                    continue
                flag, default = "--" + f.name.replace("_", "-"), f.default
                text = meta["help"] + ("" if default is None else f" (default: {default})")
                if isinstance(default, bool):
                    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
                    continue
                extra = {"choices": meta["choices"]} if meta.get("choices") else {}
                if meta.get("parse"):
                    extra["type"] = meta["parse"]
                group.add_argument(flag, default=default, help=text, **extra)
        parser.add_argument_group("speculative config", SpeculativeConfig.__doc__).add_argument(
            "--speculative-config", type=parse_json_object, default=None,
            help='speculative decoding as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
                 '"num_speculative_tokens": 3}\'')
        parser.add_argument_group("kv transfer config", KVTransferConfig.__doc__).add_argument(
            "--kv-transfer-config", type=parse_json_object, default=None,
            help='a KV connector as JSON with vLLM\'s keys, e.g. \'{"kv_connector": "OffloadingConnector", '
                 '"kv_role": "kv_both", "kv_connector_extra_config": {"kv_offloading_size": 1073741824}}\'')
        parser.add_argument_group("kv events config", KVEventsConfig.__doc__).add_argument(
            "--kv-events-config", type=parse_json_object, default=None,
            help='KV-cache events as JSON with vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, '
                 '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\'')
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config that parsed command-line arguments describe (--hash-seed defaults to $PYTHONHASHSEED)."""
        names = cls.knob_names()
        knobs = {name: getattr(args, name) for name in names if hasattr(args, name)}
        if knobs.get("hash_seed") is None and os.environ.get("PYTHONHASHSEED"):
            knobs["hash_seed"] = os.environ["PYTHONHASHSEED"]
        return cls.from_kwargs(**knobs)
