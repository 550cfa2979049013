"""Read-only views of what a `LowRankLayer` stores, trimmed to the stored tokens (its stores keep spare
capacity): what persistence, the byte count and the tests see."""

from __future__ import annotations

import torch


class StoredViews:
    """The stored parts of a `LowRankLayer` as views (a mixin of it; `_n` tokens are stored)."""

    @property
    def coef_k(self) -> torch.Tensor:
        """[G, N, r_k] (a transposed view of the token-last storage)."""
        return self._ck[..., : self._n].transpose(1, 2)

    @property
    def coef_v(self) -> torch.Tensor:
        return self._cv[:, : self._n]

    @property
    def scale_k(self) -> torch.Tensor | None:
        return None if self._sk is None else self._sk[:, : self._n].unsqueeze(-1)

    @property
    def scale_v(self) -> torch.Tensor | None:
        return None if self._sv is None else self._sv[:, : self._n].unsqueeze(-1)

    def _stored(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The stored tokens' part of a per-token store (token axis 1), or None."""
        return None if t is None else t[:, : self._n]

    @property
    def tail_k(self) -> torch.Tensor | None:
        """[G, N, bytes] packed codes of the lower key bands (None without `coef_bands`)."""
        return self._stored(self._tk)

    @property
    def tail_v(self) -> torch.Tensor | None:
        return self._stored(self._tv)

    @property
    def tail_step_k(self) -> torch.Tensor | None:
        """[G, N, bands] steps of the lower key bands."""
        return self._stored(self._tsk)

    @property
    def tail_step_v(self) -> torch.Tensor | None:
        return self._stored(self._tsv)

    @property
    def relevance(self) -> torch.Tensor | None:
        """[H, N] relevance of every stored token (None unless `max`/`mean` scoring has seen a query)."""
        return self._stored(self._rel)
