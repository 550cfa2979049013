"""Short texts about a session that the terminal UI and the REPL both print."""

from __future__ import annotations

from typing import Any


def method_label(session: Any) -> str:
    """'s4r (requested ×5)' or 'full (no compression)'."""
    if session.method == "full":
        return "full (no compression)"
    return f"{session.method} (requested ×{session.ratio_requested:g})"
