"""The connectors by name, as vLLM's KVConnectorFactory: kv_transfer_config's kv_connector picks one.

Connectors are registered as "module:Class" and imported only when built, so naming one (in a config, on the
command line) loads nothing heavy.
"""

import importlib

_REGISTRY: dict[str, str] = {}


def known_connectors() -> tuple[str, ...]:
    """Every registered connector name, in registration order."""
    return tuple(_REGISTRY)


class KVConnectorFactory:
    """Registers connector classes by name and builds them for a role."""

    @staticmethod
    def register_connector(name: str, target: str) -> None:
        """Register target ("module:Class") under name; ValueError if the name is taken."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a connector name must be a non-empty string, got {name!r}")
        if name in _REGISTRY:
            raise ValueError(f"connector {name!r} is already registered")
        if not isinstance(target, str) or target.count(":") != 1:
            raise ValueError(f"target must be 'module:Class', got {target!r}")
        _REGISTRY[name] = target

    @staticmethod
    def get_connector_class(name: str):
        """The class registered under name; ValueError listing the known names otherwise."""
        if name not in _REGISTRY:
            raise ValueError(f"kv_connector {name!r} is unknown; kvlab knows {', '.join(_REGISTRY)}")
        module, cls = _REGISTRY[name].split(":")
        return getattr(importlib.import_module(module), cls)

    @staticmethod
    def create_connector(config, role, **kwargs):
        """The connector config.kv_connector names, built for role (kwargs: what that connector needs)."""
        return KVConnectorFactory.get_connector_class(config.kv_connector)(config, role, **kwargs)


KVConnectorFactory.register_connector("OffloadingConnector",
                                      "kvlab.kv_transfer.offloading_connector:OffloadingConnector")
KVConnectorFactory.register_connector("SocketConnector", "kvlab.kv_transfer.socket_connector:SocketConnector")
