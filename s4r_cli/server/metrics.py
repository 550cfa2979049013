"""The /metrics page in Prometheus' text format (no client library: a few counters and gauges)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from s4r.serving.document_store import StoreSnapshot
from s4r.serving.engine import EngineCounters


def _escape(value: str) -> str:
    """A label value as Prometheus reads it (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _line(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        tag = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
        out.append(f"{name}{{{tag}}} {value:g}" if tag else f"{name} {value:g}")
    return out


def render_metrics(engine: EngineCounters, store: StoreSnapshot, http: Counter[tuple[str, int]],
                   queued: int, info: dict[str, Any]) -> str:
    """Every figure the server keeps, one metric family after another."""
    c = store.counters
    fams: list[tuple[str, str, str, float | list[tuple[dict[str, str], float]]]] = [
        ("s4r_info", "gauge", "The model and cache settings served.",
         [({k: str(v) for k, v in info.items()}, 1)]),
        ("s4r_http_requests_total", "counter", "HTTP requests answered, by route and status.",
         [({"route": route, "status": str(status)}, n) for (route, status), n in sorted(http.items())]),
        ("s4r_requests_total", "counter", "Chat completions answered.", engine.requests),
        ("s4r_requests_cancelled_total", "counter", "Chat completions stopped by a client that left.",
         engine.cancelled),
        ("s4r_queue_requests", "gauge", "Chat completions running or waiting for the model.", queued),
        ("s4r_prompt_tokens_total", "counter", "Prompt tokens of answered requests.", engine.prompt_tokens),
        ("s4r_cached_tokens_total", "counter", "Prompt tokens served from a held document cache.",
         engine.cached_tokens),
        ("s4r_prefill_tokens_total", "counter", "Prompt tokens prefilled after the document.",
         engine.prefilled_tokens),
        ("s4r_completion_tokens_total", "counter", "Tokens generated.", engine.completion_tokens),
        ("s4r_prefill_seconds_total", "counter", "Seconds spent prefilling prompts after the document.",
         engine.prefill_seconds),
        ("s4r_decode_seconds_total", "counter", "Seconds spent generating.", engine.decode_seconds),
        ("s4r_prefill_tokens_per_second", "gauge", "Prefill speed of the last request.",
         engine.last.get("prefill_tok_s", 0.0)),
        ("s4r_decode_tokens_per_second", "gauge", "Decode speed of the last request.",
         engine.last.get("decode_tok_s", 0.0)),
        ("s4r_document_ingests_total", "counter", "Documents read and compressed.", c.ingests),
        ("s4r_document_ingest_tokens_total", "counter", "Tokens of documents read.", c.ingested_tokens),
        ("s4r_document_ingest_seconds_total", "counter", "Seconds spent reading documents.",
         c.ingest_seconds),
        ("s4r_cache_hits_total", "counter", "Requests served from a held document, by where it was.",
         [({"where": "memory"}, c.memory_hits), ({"where": "disk"}, c.disk_hits)]),
        ("s4r_cache_evictions_total", "counter", "Documents that left memory for the budget.", c.evictions),
        ("s4r_cache_forgotten_total", "counter", "Documents dropped with no cache folder to keep them.",
         c.forgotten),
        ("s4r_cache_load_failures_total", "counter", "Saved caches refused (damaged or missing).",
         c.load_failures),
        ("s4r_kv_resident_bytes", "gauge", "Stored bytes of the document caches in memory.",
         store.resident_bytes),
        ("s4r_kv_resident_full_bytes", "gauge", "Bytes the same documents would take uncompressed.",
         store.resident_full_bytes),
        ("s4r_kv_ratio", "gauge", "Achieved compression ratio of the documents in memory.", store.ratio),
        ("s4r_memory_budget_bytes", "gauge", "The memory budget of document caches.", store.budget_bytes),
        ("s4r_documents_resident", "gauge", "Documents in memory.", store.resident_documents),
        ("s4r_documents_saved", "gauge", "Documents saved in the cache folder.", store.saved_documents),
    ]
    lines: list[str] = []
    for name, kind, help_text, samples in fams:
        lines += _line(name, kind, help_text, samples if isinstance(samples, list) else [({}, samples)])
    return "\n".join(lines) + "\n"
