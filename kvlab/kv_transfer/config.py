"""kv_transfer_config: which connector, in which role, with which connector-specific settings (vLLM's
KVTransferConfig in vllm/config/kv_transfer.py).

    KVTransferConfig.from_value({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {"kv_offloading_size": 1 << 30}})

kv_role says which way K/V flow: kv_producer instances only save (a prefill instance of a disaggregated
set-up), kv_consumer instances only load (its decode instance), kv_both do both (an offloading tier).
"""

from dataclasses import dataclass, field

from kvlab.kv_transfer.factory import known_connectors
from kvlab.validation import config_mapping

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config")


@dataclass(frozen=True)
class KVTransferConfig:
    """A connector's name, its role and its own settings; every field is checked when the config is made."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        known = known_connectors()
        if self.kv_connector not in known:
            raise ValueError(f"kv_transfer_config.kv_connector {self.kv_connector!r} is unknown; kvlab knows "
                             f"{', '.join(known)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config must be a dict, got "
                             f"{self.kv_connector_extra_config!r}")

    @property
    def is_kv_producer(self) -> bool:
        """Whether this instance saves K/V."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this instance loads K/V."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default=None):
        """One connector-specific setting, or default."""
        return self.kv_connector_extra_config.get(key, default)

    @classmethod
    def from_value(cls, value) -> "KVTransferConfig":
        """A config from a KVTransferConfig, a dict with vLLM's keys, or that dict as a JSON string."""
        if isinstance(value, cls):
            return value
        value = config_mapping("kv_transfer_config", value, FIELDS)
        if "kv_connector" not in value:
            raise ValueError(f"kv_transfer_config.kv_connector is missing; kvlab knows {', '.join(known_connectors())}")
        return cls(**value)

    def as_dict(self) -> dict:
        return {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                "kv_connector_extra_config": dict(self.kv_connector_extra_config)}
