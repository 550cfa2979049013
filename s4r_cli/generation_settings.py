"""Per-answer generation settings: the --temperature ... options' values and the REPL's `/set KEY VALUE`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from s4r_cli.cli_errors import UsageError


@dataclass
class GenerationSettings:
    """Per-answer generation knobs; the REPL's /set changes them between turns."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # like llama.cpp and ollama: 1.1 over the last 64 tokens (1 = off); the bench decodes without it
    repeat_penalty: float = 1.1
    loop_guard: bool = True

    def validate(self) -> None:
        """Raise UsageError if any value is out of range."""
        check_max_new_tokens(self.max_new_tokens)
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_seed(self.seed)
        check_repeat_penalty(self.repeat_penalty)

    def describe(self) -> str:
        """One line for /set and /stats."""
        seed = self.seed if self.seed is not None else "none"
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, max_tokens {self.max_new_tokens}, "
                f"seed {seed}, repeat_penalty {self.repeat_penalty:g}, "
                f"loop_guard {'on' if self.loop_guard else 'off'}")

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Session.ask."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "seed": self.seed, "repeat_penalty": self.repeat_penalty,
                "repeat_last_n": REPEAT_LAST_N, "loop_guard": self.loop_guard}

    def set(self, key: str, value: str) -> str:
        """Parse and apply `/set KEY VALUE`; return the canonical key. Raise UsageError when invalid."""
        key = SET_ALIASES.get(key.lower().replace("-", "_"), key)
        if key == "temperature":
            self.temperature = check_temperature(_parse_float(key, value))
        elif key == "top_p":
            self.top_p = check_top_p(_parse_float(key, value))
        elif key == "max_new_tokens":
            self.max_new_tokens = check_max_new_tokens(_parse_int(key, value))
        elif key == "seed":
            random = value.lower() in ("none", "off", "random")
            self.seed = None if random else check_seed(_parse_int(key, value))
        elif key == "repeat_penalty":
            self.repeat_penalty = check_repeat_penalty(_parse_float(key, value))
        elif key == "loop_guard":
            self.loop_guard = _parse_switch(key, value)
        else:
            raise UsageError(f"unknown setting '{key}'; settable: {SETTABLE}")
        return key


REPEAT_LAST_N = 64
MAX_REPEAT_PENALTY = 10.0
SETTABLE = "temperature, top_p, max_tokens, seed, repeat_penalty, loop_guard, truncate"
SET_ALIASES = {"temp": "temperature", "topp": "top_p", "max_tokens": "max_new_tokens",
               "max_new_tokens": "max_new_tokens", "maxtokens": "max_new_tokens",
               "repeat_penalty": "repeat_penalty", "penalty": "repeat_penalty", "loop_guard": "loop_guard"}


def _parse_switch(key: str, value: str) -> bool:
    v = value.lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise UsageError(f"{key} must be on or off, got '{value}'")


def _parse_float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UsageError(f"{key} must be a number, got '{value}'") from None


def _parse_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{key} must be a whole number, got '{value}'") from None


def check_temperature(t: float) -> float:
    """Temperature must be a finite number >= 0 (0 = greedy)."""
    if not math.isfinite(t) or t < 0:
        raise UsageError(f"temperature must be 0 (greedy) or positive, got {t:g}")
    return t


def check_top_p(p: float) -> float:
    """top_p must lie in (0, 1]."""
    if not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise UsageError(f"top_p must be in (0, 1], got {p:g}")
    return p


def check_max_new_tokens(n: int) -> int:
    """At least one new token per answer."""
    if n < 1:
        raise UsageError(f"max new tokens must be at least 1, got {n}")
    return n


def check_seed(seed: int | None) -> int | None:
    """Seeds are non-negative integers (what torch.manual_seed accepts)."""
    if seed is not None and seed < 0:
        raise UsageError(f"seed must be 0 or positive, got {seed}")
    return seed


def check_repeat_penalty(p: float) -> float:
    """1 (off) up to MAX_REPEAT_PENALTY; below 1 would reward repetition."""
    if not math.isfinite(p) or not 1.0 <= p <= MAX_REPEAT_PENALTY:
        raise UsageError(f"repeat penalty must be between 1 (off) and {MAX_REPEAT_PENALTY:g}, got {p:g}")
    return p
