"""The Chapter 3 block map in a real browser: JupyterLab runs the notebook, the grid renders, Step redraws it.

The notebook is the Chapter 3 instructor notebook when it exists, else a small one written here;
KVLAB_BROWSER_NOTEBOOK names another. The expected number of used blocks comes from the notebook
itself: a printed line `kvlab-block-map step=S used=N` (BlockMap.summary()), else the widget's counters.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvlab.paths import REPO_ROOT

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
CHAPTER_NOTEBOOK = REPO_ROOT / "solutions" / "03_paging" / "03_paging.ipynb"
SCREENSHOT_COPY = REPO_ROOT / "build" / "screenshots" / "block_map.png"
MARKER = re.compile(r"kvlab-block-map (?:step=(\d+) )?used=(\d+)")
SERVER_START_S, KERNEL_IDLE_S, RUN_ALL_S, WIDGET_S = 60, 60, 300, 60

FALLBACK_CELLS = [
    '''\
import torch
from kvlab.decoding.paged_generate import PagedGenerator
from kvlab.widgets import BlockMap

try:  # the embedded model when it is there, else a tiny random one: the widget is what is under test
    from kvlab import load_model
    model, tokenizer = load_model()
    decode = tokenizer.decode
    prompts = [tokenizer(t)["input_ids"] for t in ("ROMEO:\\n", "JULIET:\\nO Romeo, Romeo", "KING HENRY:\\nOnce more")]
except Exception:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=96)).eval()
    decode = None
    prompts = [list(range(1, 8)), list(range(20, 39)), list(range(40, 52))]''',
    '''\
def make_engine():
    engine = PagedGenerator(model, num_blocks=24, block_size=8)
    for i, (prompt, n) in enumerate(zip(prompts, (40, 30, 50))):
        engine.add_request(prompt, n, arrival_step=2 * i)
    return engine

block_map = BlockMap(make_engine, decode=decode, title="Chapter 3: three sequences on one block pool")
for _ in range(5):
    block_map.step()
display(block_map)
print(block_map.summary())''',
]


def _write_notebook(path: Path, sources: list[str]) -> None:
    cells = [{"cell_type": "code", "execution_count": None, "id": f"cell{i}", "metadata": {}, "outputs": [],
              "source": src} for i, src in enumerate(sources)]
    path.write_text(json.dumps({"cells": cells, "nbformat": 4, "nbformat_minor": 5, "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}}))


def _without_outputs(path: Path) -> None:
    # A saved run's outputs would show a stale marker and dead widgets before Run All replaces them.
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    path.write_text(json.dumps(nb))


@pytest.fixture
def notebook_path(tmp_path) -> Path:
    """The notebook to open, copied into the server's root so a run never writes into the repository."""
    root = tmp_path / "root"
    root.mkdir()
    source = Path(os.environ.get("KVLAB_BROWSER_NOTEBOOK", CHAPTER_NOTEBOOK))
    if source.exists():
        # Copy the whole chapter folder so the notebook's relative paths still resolve.
        shutil.copytree(source.parent, root / source.parent.name, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        path = root / source.parent.name / source.name
        _without_outputs(path)
        return path
    path = root / "block_map_demo.ipynb"
    _write_notebook(path, FALLBACK_CELLS)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A private JupyterLab server on 127.0.0.1, started and always stopped by the test."""

    def __init__(self, root: Path, workdir: Path):
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "jupyterlab.log"
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(workdir / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(workdir / "workspaces"), JUPYTER_RUNTIME_DIR=str(workdir / "runtime"),
                   JUPYTER_CONFIG_DIR=str(workdir / "config"), IPYTHONDIR=str(workdir / "ipython"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # No news or update toasts: they would cover the widget in the screenshot.
        notification = workdir / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notification.parent.mkdir(parents=True)
        notification.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True}))
        # Render every cell: JupyterLab's default windowing drops off-screen cells from the DOM, so
        # the prompts this test reads would vanish once Run All scrolls the notebook.
        tracker = workdir / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
        tracker.parent.mkdir(parents=True)
        tracker.write_text(json.dumps({"windowingMode": "none"}))
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                 f"--IdentityProvider.token={self.token}", "--ServerApp.allow_root=True",
                 f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                 "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )

    def api(self, path: str, method: str = "GET"):
        request = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read()
        return json.loads(body) if body else None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("/api/status")
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        raise TimeoutError(f"JupyterLab not ready after {SERVER_START_S} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        """Ask the server to shut down (it stops its kernels), then kill whatever of its group is left."""
        if self.proc.poll() is None:
            try:
                self.api("/api/shutdown", method="POST")
                self.proc.wait(timeout=10)
            except Exception:
                pass
        try:  # the group is the server's own session: its kernels, should one have outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture
def chromium():
    """Fail in CI, skip elsewhere, when the browser or Playwright is missing."""
    problem = None
    if not CHROMIUM.exists():
        problem = f"{CHROMIUM} is missing: apt-get install -y chromium"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the playwright package is not installed"
    if problem and os.environ.get("CI"):
        pytest.fail(problem)
    if problem:
        pytest.skip(problem)
    return CHROMIUM


@pytest.fixture
def jupyterlab(chromium, notebook_path, tmp_path):
    server = JupyterLab(tmp_path / "root", tmp_path)
    try:
        yield server
    finally:
        server.stop()


def _kernel_ready(server: JupyterLab, rel_path: str) -> bool:
    for session in server.api("/api/sessions"):
        if session.get("path") == rel_path:
            kernel = session.get("kernel") or {}
            return kernel.get("execution_state") == "idle" and kernel.get("connections", 0) >= 1
    return False


def _prompts(page) -> list[str]:
    return [t.strip() for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def _accept_dialogs(page) -> None:
    # A notebook without kernel metadata asks which kernel to start; take the default.
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    if accept.count():
        accept.first.click()


def _run_all(page, server: JupyterLab, rel_path: str) -> None:
    """Run All once the kernel is really attached; JupyterLab drops a Run All sent before that."""
    for attempt in range(3):
        deadline = time.monotonic() + KERNEL_IDLE_S
        while not _kernel_ready(server, rel_path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel of {rel_path} never became idle and connected:\n{server.log_tail()}")
            _accept_dialogs(page)
            time.sleep(0.25)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        started = time.monotonic()
        while time.monotonic() - started < 10:
            if any(re.fullmatch(r"\[(\*|\d+)\]:", p) for p in _prompts(page)):
                return
            time.sleep(0.2)
    raise AssertionError(f"Run All did not start after 3 tries; prompts: {_prompts(page)}")


def _wait_until_executed(page) -> dict:
    """Wait until no cell is queued or running; return the notebook (with outputs) as JupyterLab holds it."""
    deadline = time.monotonic() + RUN_ALL_S
    while any(p == "[*]:" for p in _prompts(page)) or not any(p for p in _prompts(page)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"cells still running after {RUN_ALL_S} s: {_prompts(page)}")
        time.sleep(0.25)
    return page.evaluate("() => window.jupyterapp.shell.currentWidget.context.model.toJSON()")


def _check_no_errors(nb: dict) -> None:
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                trace = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(out.get("traceback", [])))
                raise AssertionError(f"a cell raised {out['ename']}: {out['evalue']}\n{trace[-3000:]}")


def _marker(nb: dict):
    """(step or None, used) from the notebook's printed `kvlab-block-map ... used=N` line, or None."""
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            text = out.get("text") or (out.get("data") or {}).get("text/plain") or ""
            match = MARKER.search("".join(text) if isinstance(text, list) else text)
            if match:
                return (int(match[1]) if match[1] else None), int(match[2])
    return None


def _grid(widget) -> list[tuple]:
    return widget.locator(".kvlab-block").evaluate_all(
        "els => els.map(e => [e.dataset.block, e.dataset.owner, e.dataset.fill])")


def _open_and_run_all(browser, server: JupyterLab, rel_path: str, width: int):
    """Open the notebook in JupyterLab, Run All, and return (page, the executed notebook) once no cell raised."""
    server.wait_ready()
    page = browser.new_page(viewport={"width": width, "height": 1100})
    page.goto(f"{server.url}/lab/tree/{rel_path}?reset&token={server.token}")
    page.locator(".jp-NotebookPanel .jp-CodeCell").first.wait_for(timeout=WIDGET_S * 1000)
    _run_all(page, server, rel_path)
    nb = _wait_until_executed(page)
    _check_no_errors(nb)
    return page, nb


def test_block_map_renders_and_steps_in_jupyterlab(chromium, notebook_path, jupyterlab, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    rel_path = notebook_path.relative_to(tmp_path / "root").as_posix()
    with sync_playwright() as pw:
        # The browser starts while the server boots.
        browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_FLAGS)
        try:
            page, nb = _open_and_run_all(browser, jupyterlab, rel_path, width=1500)

            widget = page.locator(".kvlab-block-map-widget").first
            drawing = widget.locator(".kvlab-block-map")
            drawing.wait_for(timeout=WIDGET_S * 1000)
            step = int(drawing.get_attribute("data-step"))
            used_in_counters = int(drawing.get_attribute("data-used"))
            marker = _marker(nb)
            if marker is not None:
                marker_step, expected_used = marker
                assert marker_step in (None, step), f"the notebook printed step {marker_step}, the widget shows {step}"
            else:
                expected_used = used_in_counters
            grid = _grid(widget)
            assert len(grid) == int(drawing.get_attribute("data-num-blocks"))
            used_blocks = [b for b in grid if b[1] != ""]
            assert 0 < len(used_blocks) == expected_used == used_in_counters, (
                f"{len(used_blocks)} blocks drawn as used; the notebook says {expected_used}, "
                f"the counters line {used_in_counters}")
            assert widget.locator(".kvlab-seq").count() >= 1

            step_button = widget.locator("button", has_text="Step")
            assert step_button.is_enabled(), "the notebook's BlockMap has nothing left to run: leave it mid-generation"
            step_button.click()
            expect(drawing).to_have_attribute("data-step", str(step + 1), timeout=30_000)
            assert _grid(widget) != grid, "Step advanced the engine but the grid did not change"

            output = page.locator(".jp-OutputArea-output").filter(has=widget).first
            shot = tmp_path / "block_map.png"
            output.screenshot(path=str(shot))
            SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT_COPY)
        except Exception:
            print(f"--- JupyterLab log ---\n{jupyterlab.log_tail()}")
            raise
        finally:
            browser.close()


TIMELINE_CELLS = [
    '''\
from kvlab import SamplingParams, load_model
from kvlab.engine.llm_engine import LLMEngine
from kvlab.widgets import Timeline

model, tokenizer = load_model()

def make_engine():
    engine = LLMEngine(model, tokenizer, block_size=8, num_blocks=10, max_num_seqs=4, max_num_batched_tokens=24)
    for i, text in enumerate(["OTHELLO.\\n", "HAMLET.\\nTo be, or not", "KING LEAR.\\nNothing will come", "ROMEO.\\n"]):
        engine.add_request(f"r{i}", text, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    return engine''',
    '''\
timeline = Timeline(make_engine, decode=tokenizer.decode, title="Chapter 6: continuous batching")
for _ in range(4):
    timeline.step()
display(timeline)
print(timeline.summary())''',
]


def test_timeline_renders_and_steps_in_jupyterlab(chromium, jupyterlab, tmp_path):
    """Chapter 6's timeline and its block map draw in JupyterLab and both advance on one Step."""
    from playwright.sync_api import expect, sync_playwright

    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    path = root / "timeline_demo.ipynb"
    _write_notebook(path, TIMELINE_CELLS)
    rel_path = path.relative_to(root).as_posix()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(chromium), args=CHROMIUM_FLAGS)
        try:
            page, nb = _open_and_run_all(browser, jupyterlab, rel_path, width=1600)

            widget = page.locator(".kvlab-timeline-widget").first
            timeline = widget.locator(".kvlab-timeline")
            block_map = widget.locator(".kvlab-block-map")
            timeline.wait_for(timeout=WIDGET_S * 1000)
            assert timeline.get_attribute("data-step") == "4" == block_map.get_attribute("data-step")
            assert widget.locator(".kvlab-row").count() == 4, "one timeline row per request"
            assert widget.locator(".kvlab-cell").count() == 4 * 4, "one cell per request per step"
            cells_before = widget.locator(".kvlab-cell").evaluate_all("els => els.map(e => e.dataset.state)")
            widget.locator("button", has_text="Step").click()
            expect(timeline).to_have_attribute("data-step", "5", timeout=30_000)
            expect(block_map).to_have_attribute("data-step", "5", timeout=30_000)
            cells_after = widget.locator(".kvlab-cell").evaluate_all("els => els.map(e => e.dataset.state)")
            assert len(cells_after) == len(cells_before) + 4, "Step adds one column to the timeline"
            assert timeline.get_attribute("data-used") == block_map.get_attribute("data-used"), (
                "the timeline's pool occupancy and the block map agree")
            output = page.locator(".jp-OutputArea-output").filter(has=widget).first
            shot = tmp_path / "timeline.png"
            output.screenshot(path=str(shot))
            SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT_COPY.parent / "timeline.png")
        except Exception:
            print(f"--- JupyterLab log ---\n{jupyterlab.log_tail()}")
            raise
        finally:
            browser.close()
