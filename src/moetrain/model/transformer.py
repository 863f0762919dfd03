"""The decoder-only transformer: embedding (normalized or not) → blocks → final norm → untied LM head.

Legend: B batch, T sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

import moetrain.cpu_math  # noqa: F401  (the CPU's vector math set up before the model's first: src/moetrain/cpu_math.py)
from moetrain.model.block import Block
from moetrain.model.config import Routing, TransformerConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.kv_cache import KVCache
from moetrain.model.loss import lm_loss
from moetrain.model.moe import MoE
from moetrain.model.mtp import MultiTokenPrediction
from moetrain.model.norm import Embedding, RMSNorm
from moetrain.model.rope import RotaryEmbedding
from moetrain.model.runtime import ModelRuntime
from moetrain.model.sequence_layout import SequenceLayout, WholeSequence


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        embed_norm = RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.embedding_norm else None
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, embed_norm)
        self.rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling)
        self.runtime = ModelRuntime()  # what training tells the layers as they run, shared by them
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage
        # holds only some of the blocks.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, runtime=self.runtime) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = MultiTokenPrediction(cfg, self.runtime) if cfg.mtp_depth else None
        """model.mtp_depth > 0: the multi-token prediction modules (src/moetrain/model/mtp.py), trained
        beside the main model and left out of its outputs."""
        self.sequence: SequenceLayout = WholeSequence()
        """Where the sequence's positions live (src/moetrain/model/sequence_layout.py): the tokens,
        targets and hidden states given to `forward` are this rank's positions of each sequence
        (`sequence.shard`), the document ids the whole sequences'. Context parallelism sets the
        same layout here and in every attention layer (`set_sequence_layout`)."""

    def forward(
        self,
        tokens_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None = None,
        targets_BT: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """Logits (B, T, V); with `targets_BT`, the mean next-token cross-entropy instead (fp32
        scalar), computed `loss_chunk_tokens` tokens at a time when > 0 so that the logits of
        the whole batch never exist (src/moetrain/model/loss.py). With `doc_ids_BT`, tokens attend
        only within their document. In training with multi-token prediction the returned loss
        is still the next-token one; the modules' loss joins it in backward (src/moetrain/model/mtp.py)."""
        x_BTD = self.embed(tokens_BT)
        x_BTD = self.run_blocks(x_BTD, list(self.blocks), doc_ids_BT)
        if targets_BT is None:
            return self.lm_head(self.norm(x_BTD))
        loss = lm_loss(self.lm_head, self.norm(x_BTD), targets_BT, loss_chunk_tokens)
        if self.mtp is not None and self.training:
            e_kBTD = self.mtp.shifted_embeddings(self.embed, tokens_BT, len(self.mtp.depths))
            attention = self.sequence.attention_inputs(self.rope, x_BTD.shape[1], doc_ids_BT, x_BTD.device)
            mtp_loss = self.mtp.loss(x_BTD, e_kBTD, targets_BT, self.norm, self.lm_head, attention, loss_chunk_tokens)
            loss = self.mtp.attach(loss, mtp_loss)
        return loss

    def run_blocks(self, x_BTD: torch.Tensor, keys: list[str], doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the blocks named `keys` (layer indices, in order). A pipeline stage calls this
        with its own blocks (src/moetrain/parallel/pipeline.py)."""
        cos_TD, sin_TD, masks = self.sequence.attention_inputs(self.rope, x_BTD.shape[1], doc_ids_BT, x_BTD.device)
        for key in keys:
            x_BTD = self.blocks[key](x_BTD, cos_TD, sin_TD, masks)
        return x_BTD

    def decode(self, tokens_BT: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, T, V) of `tokens_BT` as the continuation of the positions `cache` holds (an
        empty cache: a prompt); their keys and values join the cache. Generation only
        (src/moetrain/generation.py): the whole sequence on this device, no document masks. The
        logits equal `forward`'s up to fp32 rounding (each token routed by itself, none dropped)."""
        T = tokens_BT.shape[1]
        if T > cache.max_len - cache.length:
            raise ValueError(f"{T} new positions do not fit a KV cache holding {cache.length} of {cache.max_len}.")
        cos_TD, sin_TD = self.rope.cos_sin(T, start=cache.length)
        x_BTD = self.embed(tokens_BT)
        for key, block in self.blocks.items():
            x_BTD = block(x_BTD, cos_TD, sin_TD, None, cache.layers[int(key)])
        return self.lm_head(self.norm(x_BTD))

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_len` positions, in the model's
        dtype and on its device."""
        weight = self.lm_head.weight
        return KVCache(self.cfg, max_len, batch, dtype=weight.dtype, device=weight.device)

    def set_sequence_layout(self, sequence: SequenceLayout) -> None:
        """Use `sequence` here and in every attention layer."""
        self.sequence = sequence
        mtp_blocks = [m.block for m in self.mtp.depths] if self.mtp is not None else []
        for block in [*self.blocks.values(), *mtp_blocks]:
            block.attn.sequence = sequence

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_routing(self, routing: Routing | str) -> None:
        """Switch every router to `routing` (learned or random), e.g. between benchmark windows;
        the parameters and the aux-free biases are kept."""
        routing = Routing(routing)
        for moe in self.moe_layers():
            moe.router.routing = routing

    def moe_layer_indices(self) -> list[int]:
        """Index among all the model's MoE layers of each of `moe_layers()` (a pipeline stage
        holds only some of them)."""
        return [
            int(canonical_name(name).split(".")[1]) - self.cfg.num_dense_layers
            for name, m in self.named_modules()
            if isinstance(m, MoE)
        ]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, fill: Fill | None = None) -> None:
        """Initialize every parameter and buffer (also after building on the meta device and
        `to_empty()`): truncated normal(0, init_std) for inputs, model.init_output_std for output
        projections (attention out, MLP/expert down); norms at 1; aux-free biases and sinks at 0.

        Each tensor — each expert of a stacked expert tensor — draws from its own generator seeded
        by (seed, its name, expert index). So the values do not depend on which rank holds what:
        a model split over experts, stages or shards starts exactly like the single-device one.

        `fill(param, init)` applies `init` (which fills a full, plain tensor in place) to a
        parameter; the default calls `init(param)`, a sharded layout runs it on a full temporary
        and keeps its shard (src/moetrain/parallel/fsdp.py)."""
        fill = fill or (lambda param, init: init(param))
        std = self.cfg.init_std
        out_std = self.cfg.init_output_std or std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            name = canonical_name(name)
            if isinstance(getattr(module, "sinks", None), nn.Parameter):  # attention sinks start at 0
                fill(module.sinks, nn.init.zeros_)
            if isinstance(module, RMSNorm):
                fill(module.weight, nn.init.ones_)
            elif isinstance(module, RotaryEmbedding):
                module.init_weights()
            elif isinstance(module, nn.Embedding):
                fill(module.weight, _normal_init(std, seed, f"{name}.weight"))
            elif isinstance(module, nn.Linear):
                is_output = name.endswith(("attn.wo", "w_down"))
                fill(module.weight, _normal_init(out_std if is_output else std, seed, f"{name}.weight"))
            elif isinstance(module, GroupedExperts):
                fill(module.w_gate_up_E2FD, _experts_init(module.expert_offset, std, seed, f"{name}.w_gate_up"))
                fill(module.w_down_EDF, _experts_init(module.expert_offset, out_std, seed, f"{name}.w_down"))
            elif isinstance(module, MoE):
                fill(module.router.weight, _normal_init(std, seed, f"{name}.router.weight"))
                module.router.expert_bias_E.zero_()
                for buf in module.buffers(recurse=False):
                    buf.zero_()


Fill = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None]
"""How `init_weights` applies an initializer to a parameter (see there)."""


def _normal_init(std: float, seed: int, key: str) -> Callable[[torch.Tensor], None]:
    return lambda w: _normal(w, std, seed, key)


def _experts_init(expert_offset: int, std: float, seed: int, key: str) -> Callable[[torch.Tensor], None]:
    """Each expert of a stacked (E, …) tensor from its own generator, keyed by global index."""

    def init(w_E: torch.Tensor) -> None:
        for i in range(w_E.shape[0]):
            _normal(w_E[i], std, seed, f"{key}[{expert_offset + i}]")

    return init


def canonical_name(name: str) -> str:
    """A module/parameter name without the wrappers' insertions (recompute, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _normal(w: torch.Tensor, std: float, seed: int, key: str) -> None:
    g = torch.Generator(device=w.device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
