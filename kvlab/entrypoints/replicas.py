"""Several `kvlab serve` replicas and the cache-aware router in front, from Python or one command.

    with ReplicaSet(model="default", num_replicas=3, policy="kv-cost") as replicas:   # waits until all are healthy
        client = openai.OpenAI(base_url=replicas.router_url + "/v1", api_key="unused")
        ...                                          # replicas.replica_urls; GET router_url/router/stats
        replicas.kill_replica(1)                     # SIGKILL, as a crash: the router drops it and retries elsewhere
        replicas.restart_replica(1)                  # same ports; the router re-admits it with an empty index
    # or replicas.stop(); a notebook kernel that exits stops every process as well (atexit)

    kvlab replicas --num-replicas 3 --policy kv-cost --model default --port 8000    # the same, until Ctrl-C

Each replica runs with --kv-events-config publishing on a free loopback port, with a replay socket on
another, and the router (kvlab.entrypoints.router) subscribes to both. Every process gets PYTHONHASHSEED =
hash_seed, so that all name the same tokens' blocks alike; restart_replica(i, hash_seed="7") starts one with
another seed, which the router reports as seed_mismatch. serve_args go to every replica (the same engine
settings, e.g. ["--num-blocks", "64"]); the router is told their --block-size. Logs are files in log_dir
(replica0.log, ..., router.log).
"""

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvlab.entrypoints.launch import CLI, ProcessGroup, free_port


def _replica_block_size(model: str, serve_args) -> int:
    """The --block-size serve_args give the replicas (the engine's default when they give none)."""
    from kvlab.entrypoints.cli import serve_parser

    parser = serve_parser(argparse.ArgumentParser(prog="kvlab serve", exit_on_error=False))
    try:
        known, _ = parser.parse_known_args([model, *serve_args])
    except argparse.ArgumentError as err:
        raise ValueError(f"serve_args: {err}") from None
    return known.block_size


class ReplicaSet(ProcessGroup):
    """num_replicas `kvlab serve` processes and `kvlab router` on 127.0.0.1; stop() ends them all."""

    def __init__(self, model: str = "default", num_replicas: int = 3, policy: str = "kv-cost",
                 serve_args: list[str] | tuple = (), router_args: list[str] | tuple = (), hash_seed: str | None = "0",
                 log_dir: str | Path | None = None, host: str = "127.0.0.1", port: int | None = None,
                 start_timeout_s: float = 180.0):
        from kvlab.router.policies import POLICIES

        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a model name or path, got {model!r}")
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if hash_seed is not None and not isinstance(hash_seed, str):
            raise ValueError(f"hash_seed must be a string (PYTHONHASHSEED's value) or None, got {hash_seed!r}")
        self.model, self.host, self.hash_seed = model, host, hash_seed
        self.serve_args, self.router_args = list(serve_args), list(router_args)
        self.block_size = _replica_block_size(model, self.serve_args)
        super().__init__(log_dir, {"PYTHONHASHSEED": hash_seed} if hash_seed is not None else None,
                         prefix="kvlab-replicas-")
        if hash_seed is None:
            self.env.pop("PYTHONHASHSEED", None)
        self.ports = [{"http": free_port(host), "events": free_port(host), "replay": free_port(host)}
                      for _ in range(num_replicas)]
        self.replica_urls = [f"http://{host}:{p['http']}" for p in self.ports]
        self.router_url = f"http://{host}:{port or free_port(host)}"
        self.start_timeout_s = start_timeout_s
        try:
            for i in range(num_replicas):
                self._start_replica(i)
            router = [*CLI, "router", "--policy", policy, "--model", model, "--block-size", str(self.block_size),
                      "--host", host, "--port", self.router_url.rsplit(":", 1)[1]]
            for url, ports in zip(self.replica_urls, self.ports):
                router += ["--replica", url, "--kv-events", f"tcp://{host}:{ports['events']}",
                           "--kv-events-replay", f"tcp://{host}:{ports['replay']}"]
            if hash_seed is not None:
                router += ["--hash-seed", hash_seed]
            self.start("router", router + self.router_args)
            self.wait_healthy({f"replica{i}": url for i, url in enumerate(self.replica_urls)} |
                              {"router": self.router_url}, start_timeout_s)
            self.wait_admitted(range(num_replicas), start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the router first (it would log every replica going away as a crash), then the replicas."""
        router = self._procs.get("router")
        if router is not None and router.poll() is None:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()
                router.wait(10)
        super().stop()

    def _start_replica(self, i: int, hash_seed: str | None = None) -> None:
        ports = self.ports[i]
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://{self.host}:{ports['events']}",
                  "replay_endpoint": f"tcp://{self.host}:{ports['replay']}", "topic": "kv"}
        argv = [*CLI, "serve", self.model, "--host", self.host, "--port", str(ports["http"]),
                "--served-model-name", self.model, "--kv-events-config", json.dumps(events), *self.serve_args]
        self.start(f"replica{i}", argv, env={"PYTHONHASHSEED": hash_seed} if hash_seed is not None else None)

    def stats(self) -> dict:
        """The router's GET /router/stats."""
        with urllib.request.urlopen(self.router_url + "/router/stats", timeout=10) as reply:
            return json.loads(reply.read())

    def wait_admitted(self, indices, timeout_s: float) -> None:
        """Until the router counts these replicas alive (it probes them on its own schedule)."""
        deadline = time.monotonic() + timeout_s
        while True:
            replicas = self.stats()["replicas"]
            if all(replicas[i]["alive"] for i in indices):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router has not admitted replicas {list(indices)} within {timeout_s:g} s; "
                                   f"logs in {self.log_dir}")
            time.sleep(0.05)

    def kill_replica(self, i: int) -> None:
        """SIGKILL replica i, as a crash would."""
        self.kill(f"replica{i}")

    def restart_replica(self, i: int, hash_seed: str | None = None) -> None:
        """Start replica i again on its ports (after kill_replica, or stopping it first), optionally under another
        PYTHONHASHSEED; returns once the router has admitted it."""
        name = f"replica{i}"
        proc = self._procs[name]
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        self._start_replica(i, hash_seed)
        self.wait_healthy({name: self.replica_urls[i]}, self.start_timeout_s)
        self.wait_admitted([i], self.start_timeout_s)


def replicas_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `kvlab replicas`."""
    parser.add_argument("--num-replicas", type=int, default=3)
    parser.add_argument("--policy", default="kv-cost", help="the router's policy (see kvlab router --help)")
    parser.add_argument("--model", default="default", help="the model every replica serves")
    parser.add_argument("--hash-seed", default="0", help="PYTHONHASHSEED of every process (default 0)")
    parser.add_argument("--serve-args", default="", help='flags for every replica, e.g. "--num-blocks 64"')
    parser.add_argument("--router-args", default="", help='more flags for the router, e.g. "--log-level info"')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument("--log-dir", default=None, help="where each process writes its log (default: a new "
                                                        "temporary folder)")
    return parser


def run_replicas(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`kvlab replicas`: start everything, print where it is, and stop every child on Ctrl-C or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SystemExit runs the finally below
    try:
        replicas = ReplicaSet(args.model, args.num_replicas, args.policy, shlex.split(args.serve_args),
                              shlex.split(args.router_args), args.hash_seed, args.log_dir, args.host, args.port)
    except ValueError as err:
        parser.exit(2, f"kvlab replicas: {err}\n")
    except RuntimeError as err:  # a process that would not start (its log's end is in the message)
        parser.exit(1, f"kvlab replicas: {err}\n")
    except KeyboardInterrupt:  # interrupted while starting: what had started is stopped already
        return
    try:
        print(f"kvlab replicas: router on {replicas.router_url} (policy {args.policy}; stats at /router/stats), "
              f"replicas {', '.join(replicas.replica_urls)}; logs in {replicas.log_dir}. Ctrl-C stops all.",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        replicas.stop()
