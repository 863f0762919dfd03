"""The planner prices multi-head latent attention by its own shapes: the activations one block's
attention keeps for backward are those autograd keeps in src/moetrain/model/mla.py (measured on
the CPU, FlashAttention's saved tensors stood in for), with and without the values padded for
FlashAttention; the multi-token prediction modules' FLOPs are the MFU formula's."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from moetrain.model import mla
from moetrain.model.counting import attention_saved_bytes, flops_per_token, mtp_flops_per_token
from moetrain.model.rope import RotaryEmbedding
from moetrain.presets import preset, resolve_config

T = 64


class _FlashLike(torch.autograd.Function):
    """Causal attention that keeps what FlashAttention keeps for backward: q, k, v, its output
    (laid out (B, T, H, V), returned as the (B, H, T, V) view) and an fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q_BHTK, k_BHTK, v_BHTV):
        out_BHTV = F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True)
        out_BHTV = out_BHTV.transpose(1, 2).contiguous().transpose(1, 2)
        lse_BHT = torch.zeros(q_BHTK.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q_BHTK, k_BHTK, v_BHTV, out_BHTV, lse_BHT)
        return out_BHTV


class _FlashLayout:
    def attend(self, q_BHTK, k_BHTK, v_BHTV, masks, window, sink_H=None):
        assert sink_H is None
        return _FlashLike.apply(q_BHTK, k_BHTK, v_BHTV)


def kept_bytes_per_token(m, dtype) -> float:
    """The bytes of the tensors one LatentAttention forward keeps for backward, per token (its
    input, weights and RoPE tables aside; each storage once)."""
    attention = mla.LatentAttention(m).to(dtype)
    for p in attention.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    attention.sequence = _FlashLayout()
    rope = RotaryEmbedding(m.qk_rope_head_dim, m.rope_theta)
    rope.init_weights()
    cos, sin = rope.cos_sin(T)
    x = torch.randn(1, T, m.d_model, dtype=dtype, requires_grad=True)
    outside = {t.untyped_storage().data_ptr() for t in [x, cos, sin, *attention.parameters()]}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in outside:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(x, cos, sin)
    return sum(kept.values()) / T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-padded-values", "fp32"])
@pytest.mark.parametrize("q_lora_rank", [64, 0], ids=["query-latent", "direct-queries"])
def test_the_planners_latent_attention_activations_are_what_autograd_keeps(dtype, q_lora_rank, monkeypatch):
    """dsv3-tiny at width 64, whose heads (48 wide) are 3× d_model / n_heads (DeepSeek-V3's: 192
    against 56). bf16 on a GPU pads the values to the query/key width for FlashAttention: the
    padded values and output are kept, and the output's V-wide copy wo takes; in fp32 the values
    are a view of wkv_b's output and keep all of it. Within 7%: the CPU's RMSNorm (no fused
    kernel) keeps its normalized rows in fp32 and, in bf16, an fp32 copy of its input in place of
    the latent itself, and each norm's row statistics."""
    monkeypatch.setattr(mla, "flash_pads_values", lambda q, v: q.dtype == torch.bfloat16)
    m = dataclasses.replace(preset("dsv3-tiny").model, d_model=64, q_lora_rank=q_lora_rank)
    planned = sum(attention_saved_bytes(m, 2 if dtype == torch.bfloat16 else 4, kv_copies=1, selective=False))
    measured = kept_bytes_per_token(m, dtype)
    assert abs(measured - planned) <= 0.07 * measured, (planned, measured)


@pytest.mark.parametrize("name", ["dsv3-tiny", "tiny"])
def test_the_multi_token_modules_cost_the_mfu_formulas_flops(name):
    """The step time's multi-token prediction FLOPs are what the MFU formula adds for them (its
    attention by the model's head widths), but their four norms' 6 × 4D."""
    cfg = resolve_config(name, ["model.mtp_depth=1"])
    m = cfg.model
    added = flops_per_token(m, cfg.data.seq_len) - flops_per_token(
        dataclasses.replace(m, mtp_depth=0), cfg.data.seq_len
    )
    assert added - mtp_flops_per_token(m, cfg.data.seq_len) == 6 * 4 * m.d_model
