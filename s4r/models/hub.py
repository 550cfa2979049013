"""Models from the Hugging Face hub, with a short reachability probe so being offline fails in seconds."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from s4r.errors import ModelLoadError
from s4r.models.hf_load import from_pretrained
from s4r.models.load_progress import Progress, report

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["hub_offline", "hub_reachable", "load_hub"]

HUB_PROBE_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub (or the proxy in front of it) accepts a TCP connection within ``timeout`` seconds."""
    # huggingface_hub retries an unreachable host for ~25 s before failing; one short probe avoids that.
    proxy_vars = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    proxy = next((os.environ[k] for k in proxy_vars if os.environ.get(k)), "")
    url = urlparse(proxy or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname
    if not host:
        return True
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def hub_offline() -> bool:
    """Whether to use only the local Hugging Face cache: offline mode is set, or the hub cannot be reached."""
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover
        pass
    return os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in ("1", "true", "yes") or not hub_reachable()



def load_hub(
    hf_id: str, *, progress: Progress | None, **kw: Any
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``hf_id`` from the hub, or from the local cache alone when offline (one clear line if absent)."""
    offline = hub_offline()
    # Hub downloads have no fraction to report (their own bars are silenced), only that they happen.
    if offline:
        report(progress, "load", 0.0)
    else:
        report(progress, "download", None)
    try:
        return from_pretrained(hf_id, what=f"'{hf_id}' from the Hugging Face hub", local_only=offline, **kw)
    except ModelLoadError as exc:
        if offline:
            raise ModelLoadError(
                f"cannot load '{hf_id}': the Hugging Face hub is unreachable (offline?) and the model is "
                "not in the local Hugging Face cache"
            ) from exc
        raise

