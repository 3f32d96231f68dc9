"""A disaggregated prefill/decode set-up from Python: two `kvlab serve` processes and `kvlab proxy` in front.

    with DisaggregatedServers(model="default") as servers:      # free loopback ports, waits until all are healthy
        client = openai.OpenAI(base_url=servers.proxy_url + "/v1", api_key="unused")
        ...                                                      # servers.prefill_url, servers.decode_url too
    # or servers.stop(); a notebook kernel that exits stops them as well (atexit)

The prefill server runs SocketConnector as kv_producer (its side channel on a free port, reported in the
kv_transfer_params it returns), the decode server as kv_consumer; serve_args go to both servers (the same
engine settings, e.g. ["--num-blocks", "256"]). Their logs are files in log_dir, for when one will not start.
"""

import json
from pathlib import Path

from kvlab.entrypoints.launch import CLI, ProcessGroup, free_port, healthy

__all__ = ["DisaggregatedServers", "free_port", "healthy"]


class DisaggregatedServers(ProcessGroup):
    """A prefill server, a decode server and the proxy, as subprocesses on 127.0.0.1; stop() ends all three."""

    def __init__(self, model: str = "default", serve_args: list[str] | tuple = (), kv_send_timeout_s: float = 120.0,
                 kv_pull_timeout_s: float = 30.0, fallback_local_prefill: bool = False,
                 prefill_timeout_s: float = 120.0, start_timeout_s: float = 180.0, host: str = "127.0.0.1",
                 log_dir: str | Path | None = None, env: dict | None = None):
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a model name or path, got {model!r}")
        super().__init__(log_dir, env, prefix="kvlab-disagg-")
        self.host = host
        ports = {name: free_port(host) for name in ("prefill", "decode", "proxy")}
        self.prefill_url, self.decode_url, self.proxy_url = (f"http://{host}:{ports[n]}"
                                                             for n in ("prefill", "decode", "proxy"))
        roles = {"prefill": {"kv_connector": "SocketConnector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"kv_host": host, "kv_port": 0,
                                                           "kv_send_timeout_s": kv_send_timeout_s}},
                 "decode": {"kv_connector": "SocketConnector", "kv_role": "kv_consumer",
                            "kv_connector_extra_config": {"kv_pull_timeout_s": kv_pull_timeout_s}}}
        try:
            for name, config in roles.items():
                self.start(name, [*CLI, "serve", model, "--host", host, "--port", str(ports[name]),
                                  "--served-model-name", model, "--kv-transfer-config", json.dumps(config),
                                  *serve_args])
            proxy = [*CLI, "proxy", "--prefill", self.prefill_url, "--decode", self.decode_url, "--host", host,
                     "--port", str(ports["proxy"]), "--prefill-timeout-s", str(prefill_timeout_s)]
            self.start("proxy", proxy + (["--fallback-local-prefill"] if fallback_local_prefill else []))
            self.wait_healthy({"prefill": self.prefill_url, "decode": self.decode_url, "proxy": self.proxy_url},
                              start_timeout_s)
        except BaseException:
            self.stop()
            raise
