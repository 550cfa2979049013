"""How a rank splits into coefficient bands: the band spec ("8:2,4:3,2:3") and the widths it gives.

Plain Python (no torch), so the settings can check a spec (`s4r.config`) and the byte accounting can
size bands (`s4r.core.budget`) without the encoders of `s4r.core.coef_bands`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Max (1960): MSE-optimal step of a uniform quantizer for a unit Gaussian, by bit width
GAUSSIAN_STEP = {2: 0.9957, 4: 0.3352}
LOW_BITS = tuple(GAUSSIAN_STEP)


@dataclass(frozen=True)
class BandPlan:
    """Widths of the int8 lead band and of each lower band (bits, width) of one rank."""

    lead: int
    tails: tuple[tuple[int, int], ...] = ()

    @property
    def rank(self) -> int:
        return self.lead + sum(w for _, w in self.tails)

    @property
    def tail_bytes(self) -> int:
        """Packed code bytes per token and basis group of the lower bands."""
        return sum(w * bits // 8 for bits, w in self.tails)

    @property
    def tail_count(self) -> int:
        return len(self.tails)


def parse_band_spec(spec: str) -> tuple[tuple[int, float], ...]:
    """'8:1,4:3,2:4' -> ((8, 1.0), (4, 3.0), (2, 4.0)): bit widths and their relative shares of the rank.

    The first entry must be 8 bits (the scoring band); the others 4 or 2 bits, in decreasing order."""
    parts: list[tuple[int, float]] = []
    for item in spec.split(","):
        bits_text, _, share_text = item.strip().partition(":")
        try:
            bits, share = int(bits_text), float(share_text)
        except ValueError:
            raise ValueError(f"bad coefficient band '{item}' in '{spec}' (want bits:share, e.g. 8:1,4:3,2:4)"
                             ) from None
        if share <= 0:
            raise ValueError(f"coefficient band share must be positive in '{spec}'")
        parts.append((bits, share))
    if not parts or parts[0][0] != 8:
        raise ValueError(f"the first coefficient band must be 8 bits, got '{spec}'")
    tails = [b for b, _ in parts[1:]]
    ordered = tails == sorted(set(tails), reverse=True)
    if any(b not in LOW_BITS for b in tails) or not ordered:
        raise ValueError(f"lower coefficient bands must be 4 then 2 bits, got '{spec}'")
    return tuple(parts)


# kept: the rank solver sizes a few hundred candidate ranks a layer (`s4r.core.budget.solve_ranks`)
@lru_cache(maxsize=4096)
def plan_bands(rank: int, spec: str | None) -> BandPlan:
    """Split `rank` columns into bands by the shares of `spec` (None: one int8 band of `rank`).

    Lower bands are rounded down to whole bytes (4-bit widths even, 2-bit widths a multiple of 4);
    what rounding frees goes to the int8 band, which always keeps at least one column."""
    if spec is None:
        return BandPlan(rank)
    parts = parse_band_spec(spec)
    total = sum(share for _, share in parts)
    tails = []
    for bits, share in parts[1:]:
        per_byte = 8 // bits
        width = int(rank * share / total) // per_byte * per_byte
        if width:
            tails.append((bits, width))
    lead = rank - sum(w for _, w in tails)
    while lead < 1 and tails:  # tiny ranks: give the int8 band a column back
        bits, width = tails[-1]
        width -= 8 // bits
        tails = tails[:-1] + ([(bits, width)] if width else [])
        lead = rank - sum(w for _, w in tails)
    return BandPlan(max(lead, 1), tuple(tails))
