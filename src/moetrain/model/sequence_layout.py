"""Sequence layouts: the seam between attention and where a sequence's positions live.

Legend: B sequences, T positions this rank holds, D head dim (RoPE tables), H query heads,
G key/value heads, Dh head dim.

The model asks its layout which positions this rank holds (`shard`), what every attention layer
takes besides its hidden state (`attention_inputs`) and the attention of the local queries over
the whole sequence (`attend`), and never communicates itself. `WholeSequence` is the one-device
layout; context parallelism swaps in `ContextShard` (src/moetrain/parallel/context_parallel.py).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from moetrain.model.local_attention import local_attention
from moetrain.model.rope import RotaryEmbedding
from moetrain.model.sinks import sdpa


@runtime_checkable
class SequenceLayout(Protocol):
    """Where the positions of a sequence live (the attention's only view of it)."""

    def shard(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions of whole sequences `x_BT` (B, T_whole, …) along dim 1."""
        ...

    def attention_inputs(
        self, rope: RotaryEmbedding, T: int, doc_ids_BT: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """RoPE's cos/sin (T, D) at the T positions this rank holds, and the masks `attend`
        takes: with `doc_ids_BT` (B, T_whole: the whole sequences' document ids) tokens attend
        only within their document; None means plain causal attention."""
        ...

    def attend(
        self,
        q_BHTD: torch.Tensor,
        k_BGTD: torch.Tensor,
        v_BGTD: torch.Tensor,
        masks: Any,
        window: int = 0,
        sink_H: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention (B, H, T, Dh) of this rank's queries over every position of the
        sequence up to theirs (with `window`, the last `window` of them: src/moetrain/model/local_attention.py),
        with this rank's keys and values; `masks` from `attention_inputs`; `sink_H`: the
        attention sinks (src/moetrain/model/sinks.py), or None."""
        ...


class WholeSequence:
    """Every position of every sequence is on this rank (no context parallelism)."""

    def shard(self, x_BT: torch.Tensor) -> torch.Tensor:
        return x_BT

    def attention_inputs(
        self, rope: RotaryEmbedding, T: int, doc_ids_BT: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """cos/sin for positions 0 … T − 1 and, with document ids, the (B, T, T) mask: same
        document and not later."""
        cos_TD, sin_TD = rope.cos_sin(T)
        mask_BTT = None
        if doc_ids_BT is not None:
            causal_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            mask_BTT = (doc_ids_BT.unsqueeze(2) == doc_ids_BT.unsqueeze(1)) & causal_TT
        return cos_TD, sin_TD, mask_BTT

    def attend(
        self,
        q_BHTD: torch.Tensor,
        k_BGTD: torch.Tensor,
        v_BGTD: torch.Tensor,
        mask_BTT: torch.Tensor | None,
        window: int = 0,
        sink_H: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window:
            return local_attention(q_BHTD, k_BGTD, v_BGTD, window, mask_BTT, sink_H)
        if mask_BTT is None:
            return sdpa(q_BHTD, k_BGTD, v_BGTD, causal=True, sink_H=sink_H)
        # document masking: the mask already contains causality
        return sdpa(q_BHTD, k_BGTD, v_BGTD, mask_BTT.unsqueeze(1), sink_H=sink_H)
