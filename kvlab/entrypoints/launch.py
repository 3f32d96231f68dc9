"""Starting `kvlab` server processes from Python on loopback: free ports, log files, waiting for /health, cleanup.

DisaggregatedServers (kvlab.entrypoints.disagg) and ReplicaSet (kvlab.entrypoints.replicas) are both a
ProcessGroup: each child runs `python -m kvlab.entrypoints.cli ...` with this checkout on its PYTHONPATH, writes
its output to log_dir/<name>.log, and stop() (or the interpreter's exit, through atexit) terminates and reaps
every child, killing one that has not ended 10 s after SIGTERM.
"""

import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CLI = (sys.executable, "-m", "kvlab.entrypoints.cli")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at the moment (the server that binds it next is almost always the one asking)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET url/health answers 200 within timeout_s."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ProcessGroup:
    """Named child processes with a log file each; stop() ends them all, and so does the interpreter's exit."""

    def __init__(self, log_dir: str | Path | None = None, env: dict | None = None, prefix: str = "kvlab-"):
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=prefix))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}
        atexit.register(self.stop)  # registered first: a start that fails half-way still cleans up
        self.env = {**os.environ, **(env or {})}
        # The children import the same kvlab as this process (a checkout that is not the installed one included).
        package_root = str(Path(__file__).resolve().parents[2])
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, self.env.get("PYTHONPATH")) if p)

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start argv as the child called name (its log appended to log_dir/<name>.log); env adds variables."""
        old = self._logs.pop(name, None)
        if old is not None:
            old.close()
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self._logs[name] = log
        self._procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             env={**self.env, **(env or {})}, stdin=subprocess.DEVNULL)
        return self._procs[name]

    def wait_healthy(self, urls: dict[str, str], timeout_s: float) -> None:
        """Until GET /health answers 200 at every url (name -> base URL); RuntimeError with the log of a child that
        exited, or naming those still not healthy after timeout_s."""
        deadline = time.monotonic() + timeout_s
        pending = dict(urls)
        while pending:
            for name in list(pending):
                proc = self._procs.get(name)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"the {name} server exited with code {proc.returncode}:\n{self.log_tail(name)}")
                if healthy(pending[name]):
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(pending)} not healthy within {timeout_s:g} s; logs in {self.log_dir}")
            time.sleep(0.1)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        """The end of one child's log."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self._procs.items()}

    def kill(self, name: str) -> None:
        """Kill one child now (SIGKILL), as a crash would: for showing what the others do then."""
        proc = self._procs[name]
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        """Terminate and reap every child (killed after 10 s); safe to call twice."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self._logs.values():
            log.close()
        self._logs = {}
        atexit.unregister(self.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
