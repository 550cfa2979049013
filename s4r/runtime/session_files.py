"""A session saved to a file and continued from it: its cache (`s4r.runtime.persist`) with what identifies the
model and settings it was made with, and the conversation state around the cache."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from s4r.distributed.rank_files import check_saved_ranks, ranks_meta
from s4r.errors import CacheFileError
from s4r.runtime.persist import load_cache, read_header, save_cache

# The functions here read and set the attributes of a `s4r.runtime.session.Session`, which imports this
# module; naming the class here would close a circle, so it is taken as any object.
SessionLike = Any

# what must match between a saved cache and the session loading it: (identity key, what the error calls it)
MATCHED = (("fingerprint", "model"), ("method", "method"), ("ratio", "ratio"), ("overrides", "settings"),
           ("dtype", "dtype"))
# the value an error shows for a mismatch of each key (the fingerprint is shown as the model's name)
SHOWN = {"fingerprint": "model"}


def model_fingerprint(model) -> str:
    """Identity of a model's shape and weights (a sample of them), to refuse foreign saved caches."""
    digest = hashlib.sha256()
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size"):
        digest.update(f"{key}={getattr(cfg, key, None)};".encode())
    emb = model.get_input_embeddings().weight
    if hasattr(emb, "to_local"):  # tensor parallel: this rank's slice identifies its part of the cache
        emb = emb.to_local()
    digest.update(emb.detach()[:8].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def session_identity(session: SessionLike) -> dict[str, Any]:
    """The model, method and settings a session's cache is made with."""
    return {"model": str(session.loaded.name), "fingerprint": model_fingerprint(session.model),
            "method": session.method, "ratio": session.ratio_requested if session.method != "full" else None,
            "overrides": session.config_overrides or {},
            # by name: bf16 and fp16 have the same width
            "dtype": str(session.dtype).removeprefix("torch.")}


def save_session(session: SessionLike, path: str | Path) -> None:
    """Save the session's cache and what is needed to continue the conversation."""
    if session.cache is None:
        raise CacheFileError("nothing to save yet: ingest a document first")
    cp = session._doc_checkpoint
    meta = {"identity": session_identity(session), "system": session.system, "state": session._state,
            "document_tokens": session.document_tokens, "documents": session.documents,
            "doc_checkpoint": list(cp) if cp else None, "compress_info": session.compress_info,
            "tokens": session.logical_length, "ranks": ranks_meta()}
    save_cache(path, session.cache, meta)


def saved_meta(path: str | Path) -> dict[str, Any]:
    """The metadata a session was saved with (read before its cache is verified and loaded)."""
    return read_header(path).get("meta", {})


def session_kwargs(meta: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Session` arguments: those given, the rest (system, method, ratio, settings) as saved."""
    identity = meta.get("identity", {})
    kwargs = dict(kwargs)
    kwargs.setdefault("system", meta.get("system"))
    kwargs.setdefault("method", identity.get("method", "s4r"))
    if identity.get("ratio") is not None:
        kwargs.setdefault("ratio", identity["ratio"])
    kwargs.setdefault("config_overrides", identity.get("overrides") or None)
    return kwargs


def restore_session(session: SessionLike, path: str | Path, meta: dict[str, Any]) -> None:
    """Fill a new `session` from the file at `path` (saved with `meta`); refuses a cache made with
    another model or settings."""
    check_saved_ranks(meta, path)
    saved, ours = meta.get("identity", {}), session_identity(session)
    for key, label in MATCHED:
        if saved.get(key) != ours.get(key):
            shown = SHOWN.get(key, key)
            raise CacheFileError(f"saved cache {path} was made with {label} {saved.get(shown)!r}, "
                                 f"this session uses {ours.get(shown)!r}")
    cache = session._new_cache()
    load_cache(path, cache, session.rope, getattr(session, "layer_devices", None) or session.device)
    cache.prepare_decode()  # as after an ingest: the first question does not wait for the fused step's views
    session.cache = cache
    session._state = meta.get("state", "open")
    session.document_tokens = int(meta.get("document_tokens", 0))
    session.documents = list(meta.get("documents", []))
    cp = meta.get("doc_checkpoint")
    session._doc_checkpoint = (int(cp[0]), str(cp[1])) if cp else None
    session.compress_info = meta.get("compress_info", {})
