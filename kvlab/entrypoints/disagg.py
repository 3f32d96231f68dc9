"""A disaggregated prefill/decode set-up from Python: two `kvlab serve` processes and `kvlab proxy` in front.

    with DisaggregatedServers(model="default") as servers:      # free loopback ports, waits until all are healthy
        client = openai.OpenAI(base_url=servers.proxy_url + "/v1", api_key="unused")
        ...                                                      # servers.prefill_url, servers.decode_url too
    # or servers.stop(); a notebook kernel that exits stops them as well (atexit)

The prefill server runs SocketConnector as kv_producer (its side channel on a free port, reported in the
kv_transfer_params it returns), the decode server as kv_consumer; serve_args go to both servers (the same
engine settings, e.g. ["--num-blocks", "256"]). Their logs are files in log_dir, for when one will not start.
"""

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at the moment (the server that binds it next is almost always the one asking)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class DisaggregatedServers:
    """A prefill server, a decode server and the proxy, as subprocesses on 127.0.0.1; stop() ends all three."""

    def __init__(self, model: str = "default", serve_args: list[str] | tuple = (), kv_send_timeout_s: float = 120.0,
                 kv_pull_timeout_s: float = 30.0, fallback_local_prefill: bool = False,
                 prefill_timeout_s: float = 120.0, start_timeout_s: float = 180.0, host: str = "127.0.0.1",
                 log_dir: str | Path | None = None, env: dict | None = None):
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a model name or path, got {model!r}")
        self.host = host
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvlab-disagg-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs = []
        atexit.register(self.stop)  # registered first: a start that fails half-way still cleans up
        env = {**os.environ, **(env or {})}
        # The children import the same kvlab as this process (a checkout that is not the installed one included).
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        ports = {name: free_port(host) for name in ("prefill", "decode", "proxy")}
        self.prefill_url, self.decode_url, self.proxy_url = (f"http://{host}:{ports[n]}"
                                                             for n in ("prefill", "decode", "proxy"))
        roles = {"prefill": {"kv_connector": "SocketConnector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"kv_host": host, "kv_port": 0,
                                                           "kv_send_timeout_s": kv_send_timeout_s}},
                 "decode": {"kv_connector": "SocketConnector", "kv_role": "kv_consumer",
                            "kv_connector_extra_config": {"kv_pull_timeout_s": kv_pull_timeout_s}}}
        cli = [sys.executable, "-m", "kvlab.entrypoints.cli"]
        try:
            for name, config in roles.items():
                self._start(name, [*cli, "serve", model, "--host", host, "--port", str(ports[name]),
                                   "--served-model-name", model, "--kv-transfer-config", json.dumps(config),
                                   *serve_args], env)
            proxy = [*cli, "proxy", "--prefill", self.prefill_url, "--decode", self.decode_url, "--host", host,
                     "--port", str(ports["proxy"]), "--prefill-timeout-s", str(prefill_timeout_s)]
            self._start("proxy", proxy + (["--fallback-local-prefill"] if fallback_local_prefill else []), env)
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, argv: list[str], env: dict) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             stdin=subprocess.DEVNULL)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        urls = {"prefill": self.prefill_url, "decode": self.decode_url, "proxy": self.proxy_url}
        pending = dict(urls)
        while pending:
            for name in list(pending):
                if self._procs[name].poll() is not None:
                    raise RuntimeError(f"the {name} server exited with code {self._procs[name].returncode}:\n"
                                       f"{self.log_tail(name)}")
                if _healthy(pending[name]):
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(pending)} not healthy within {timeout_s:g} s; logs in {self.log_dir}")
            time.sleep(0.1)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of one process's log ("prefill", "decode" or "proxy")."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def kill(self, name: str) -> None:
        """Kill one of the three now (SIGKILL), as a crash would: for showing what the others do then."""
        proc = self._procs[name]
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        """Terminate and reap all three (killed after 10 s); safe to call twice."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self._logs:
            log.close()
        self._logs = []
        atexit.unregister(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
