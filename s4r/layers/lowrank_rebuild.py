"""The pre-RoPE keys a decode step rebuilds, a mixin of `LowRankLayer`: the selected tokens' coefficients
decoded from their bands, times the key basis (in the model's dtype, by one int8 product, or in fp32),
rotated to their positions and dotted with the query. The eager reference of the fused step's rebuild
(`s4r.kernels.s4r_step`); scoring and selection are `s4r.layers.lowrank_selection`'s.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from s4r.core.int8_rebuild import int8_basis, int8_keys, int8_rows
from s4r.core.rope import half_angles, rotate_dim_major
from s4r.core.subspace import head_blocks
from s4r.core.tail_planes import decode_planar, gather_token_rows, planar_basis, plane_map
from s4r.kernels import jit

# the selected-token counts a model-dtype rebuild rounds up to (see `_model_dtype_key_logits`)
REBUILD_BUCKET = 128
# multiply-adds a rebuilt key costs (the basis's size) from which a bf16 model on a CPU with AMX-BF16
# rebuilds in bf16, not int8: oneDNN's AMX products outrun the int8 kernel there, small ones do not
# (BENCHMARKS.md, "qwen3-0.6b at 32,768 tokens")
AMX_REBUILD_MACS = 1 << 17


def gpu_kernels(layer) -> ModuleType | None:
    """`s4r.kernels.triton_step` where its Triton kernels may serve `layer`'s step (a CUDA device, or Triton's
    interpreter on a CPU, and `triton_step.serves`), else None: Triton is imported only then."""
    if layer.basis_k.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from s4r.kernels import triton_step
    except ImportError:  # no Triton here: the eager step serves
        return None
    return triton_step if triton_step.serves(layer) else None


class KeyRebuild:
    """The selected pre-RoPE keys of a `LowRankLayer` rebuilt and dotted with the query (a mixin of it)."""

    def _rebuilt_key_logits(self, qf, idx, scaling):
        """Pre-RoPE keys: rebuild the selected keys, rotate them to their positions, dot with the query
        (on a GPU in one Triton kernel where it serves, `s4r.kernels.triton_step`)."""
        if (kernels := gpu_kernels(self)) is not None:
            fused = kernels.key_logits(self, qf, idx, scaling, head_blocks(self.basis_k, self.heads))
            if fused is not None:
                return fused
        if self.rebuild_int8:
            return self._int8_key_logits(qf, idx, scaling)
        if self.rebuild_dtype != torch.float32:
            return self._model_dtype_key_logits(qf, idx, scaling)
        return torch.matmul(qf, self._rotated(self._rebuilt_keys(idx), idx)).mul_(scaling)

    def _rotated(self, keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rebuilt keys [H, d, k] of the stored tokens `idx` [B, k] rotated to their positions."""
        cos, sin = half_angles(self.rope, idx.reshape(-1) + self.sinks, self.sinks + self._n)  # [d/2, B*k]
        batch, k = idx.shape
        if batch > 1:  # one token set per head: each head's own positions (explicit sizes: k may be 0)
            cos = cos.view(cos.shape[0], batch, k).transpose(0, 1)
            sin = sin.view(sin.shape[0], batch, k).transpose(0, 1)
        return rotate_dim_major(keys, cos, sin)

    def _model_dtype_key_logits(self, qf: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_rebuilt_key_logits` with the keys rebuilt in the model's dtype: one product of the basis as
        stored (`planar_basis`) with the selected tokens' decoded coefficients (bf16 in, fp32
        accumulated: oneDNN's bf16 products run about 4x its fp32 ones on an AVX512-BF16 CPU), so the
        keys are rounded to bf16 as the model's own keys are; then rotated and dotted in fp32. Everything
        runs with the token axis last, where elementwise operands are contiguous (a token-major rotation,
        with 32-wide rows broadcast over heads, took four times as long)."""
        batch, k = idx.shape
        if k == 0:
            return qf.new_empty(self.heads, qf.shape[1], 0)
        # oneDNN builds a bf16 product's kernel per shape (about 0.6 ms, more than the product): the token
        # count is rounded up to a bucket by repeating the last token, so a few shapes serve every step
        padded = torch.cat([idx, idx[:, -1:].expand(-1, -k % REBUILD_BUCKET)], dim=1)
        coefs, _ = self._decoded_key_cols(padded, self.rebuild_dtype)  # [B, r, k']
        blocks = head_blocks(self.basis_k, self.heads)  # [H, d, r]
        if self._tk is not None:
            blocks = planar_basis(blocks, self.plan_k)
        keys = _product(blocks.to(coefs.dtype), coefs)[..., :k].float()  # [H, d, k]
        return torch.matmul(qf, self._rotated(keys, idx)).mul_(scaling)

    def _int8_key_logits(self, qf: torch.Tensor, idx: torch.Tensor, scaling: float) -> torch.Tensor:
        """`_rebuilt_key_logits` with the keys rebuilt by one int8 product (`s4r.core.int8_rebuild`): the
        reference of the fused step's, here as fp32 products of the integer codes (exact)."""
        if idx.shape[1] == 0:
            return qf.new_empty(self.heads, qf.shape[1], 0)
        coefs, step = self._decoded_key_cols(idx, torch.float32)
        rows = int8_rows(coefs, step)
        memo = getattr(self, "_int8_blocks", None)
        if memo is None or memo[0] is not self.basis_k:
            blocks = head_blocks(self.basis_k, self.heads)
            if self._tk is not None:
                blocks = planar_basis(blocks, self.plan_k)
            memo = self._int8_blocks = (self.basis_k, *int8_basis(blocks))
        keys = int8_keys(memo[1], memo[2], rows, step)
        return torch.matmul(qf, self._rotated(keys, idx)).mul_(scaling)

    def _decoded_key_cols(self, idx: torch.Tensor,
                          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stored keys `idx` [B, k] decoded token axis last in `dtype`, [B, r, k], as `planar_basis`
        multiplies them: int8 codes times their scale, then the lower bands in `plane_order`; and the
        scales [B, 1, k] (None for model-dtype coefficients)."""
        cols, scale = self._key_columns(idx)
        batch, k = idx.shape
        lead = self.plan_k.lead
        out = torch.empty(batch, self.basis_k.shape[-1], k, dtype=dtype, device=cols.device)
        if scale is None:
            out[:, :lead] = cols
        else:
            torch.mul(cols, scale, out=out[:, :lead])
        if self._tk is not None:
            codes, steps = gather_token_rows(self._tk, idx), gather_token_rows(self._tsk, idx)
            decode_planar(codes, steps, self.plan_k, out[:, lead:])
        return out, scale

    def _rebuilt_keys(self, idx: torch.Tensor) -> torch.Tensor:
        """The stored keys `idx` [H or 1, k] rebuilt dimension-major in fp32, [H, d, k]
        (`rebuild_dtype="float32"`): the int8 band is gathered by column from its stored [G, r, N] layout
        and the lower bands stay planes, each through its own slice of the basis (the plane map folded
        into it), so no decoded coefficient rows are formed."""
        cols, scale = self._key_columns(idx)
        lead = self.plan_k.lead
        cols = cols.float() if scale is None else cols.float().mul_(scale.float())
        blocks = head_blocks(self.basis_k, self.heads).float()  # [H, d, r]
        keys = _product(blocks[..., :lead], cols)
        if self._tk is not None:
            tail = self.planar_tail(idx, keys=True)
            folded = torch.matmul(blocks[..., lead:], plane_map(self.plan_k, str(keys.device)).T)
            keys += _product(folded, tail.planes)
        return keys

    @property
    def rebuild_dtype(self) -> torch.dtype:
        """The dtype a step rebuilds keys in where it does not use int8 (`rebuild_int8`): with
        `rebuild_dtype` "model" (or "auto", "int8") the model's where its products are fast (bf16, or any
        dtype on a GPU; a CPU's fp16 products are slow), else fp32."""
        fast = self.dtype == torch.bfloat16 or self.basis_k.device.type == "cuda"
        return self.dtype if self.cfg.rebuild_dtype != "float32" and fast else torch.float32

    @property
    def rebuild_int8(self) -> bool:
        """Whether a decode step rebuilds its selected keys by one int8 product: `rebuild_dtype="int8"`, or
        "auto" on a CPU with int8 dot products (unless AMX-BF16 products are faster: `AMX_REBUILD_MACS`),
        where the coefficients are int8-coded on a CPU."""
        choice = self.cfg.rebuild_dtype
        if choice not in ("int8", "auto") or self._sk is None or self.basis_k.device.type != "cpu":
            return False
        return choice == "int8" or (jit.int8_products() and not self._amx_rebuild())

    def _amx_rebuild(self) -> bool:
        """Whether `rebuild_dtype="auto"` rebuilds a bf16 model's keys in bf16 on this CPU's AMX tiles."""
        return (self.dtype == torch.bfloat16 and self.basis_k.numel() >= AMX_REBUILD_MACS
                and "amx_bf16" in jit.cpu_flags())

    def _key_columns(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The int8 (or model-dtype) band of the stored keys `idx` [B, k], gathered by column from the
        [G, r, N] layout: ([B, lead, k], int8 scales [B, 1, k] or None)."""
        n = self._n
        batch, k = idx.shape
        if self._ck.shape[0] == 1:
            flat = idx.reshape(-1)
            # gather, not index_select: its int8 column path is five times slower (80 against 16 us)
            cols = torch.gather(self._ck[0, :, :n], 1, flat.expand(self._ck.shape[1], -1))
            cols = cols.view(self._ck.shape[1], batch, k).transpose(0, 1)
            scale = None if self._sk is None else self._sk[0, :n].index_select(0, flat).view(batch, 1, k)
        else:
            cols = torch.gather(self._ck[..., :n], 2, idx.unsqueeze(1).expand(-1, self._ck.shape[1], -1))
            scale = None if self._sk is None else torch.gather(self._sk[:, :n], 1, idx).unsqueeze(1)
        return cols, scale


def _product(blocks: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """blocks [H, d, x] times cols [B, x, k] (B = 1: shared by every head): [H, d, k]. A shared `cols` is
    one matrix product over the heads' stacked rows, not a batched one over an expanded copy."""
    heads, d, _ = blocks.shape
    if cols.shape[0] == 1:
        return torch.matmul(blocks.reshape(heads * d, -1), cols[0]).view(heads, d, -1)
    return torch.matmul(blocks, cols)
