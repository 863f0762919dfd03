"""Rotary position embeddings (RoPE), "rotate-half" convention (as Llama/Qwen in HF).

Legend: B batch, T sequence, H heads, Dh head dim.
"""

import math

import torch
from torch import nn

from moetrain.model.config import RopeScaling, RopeScalingConfig


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: RopeScalingConfig | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling or RopeScalingConfig()
        self.attention_factor = yarn_attention_factor(self.scaling) if self.scaling.type == RopeScaling.yarn else 1.0
        """What cos and sin are multiplied by (YaRN's)."""
        # Not persistent: derived from the config, rebuilt by init_weights (works after meta init).
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
            pos_freqs = self.theta ** (exponents / self.head_dim)
            inv_freq = 1.0 / pos_freqs
            if self.scaling.type == RopeScaling.llama3:
                inv_freq = llama3_inv_freq(inv_freq, self.scaling)
            elif self.scaling.type == RopeScaling.yarn:
                inv_freq = yarn_inv_freq(pos_freqs, self.theta, self.scaling)
            self.inv_freq.copy_(inv_freq)

    def cos_sin(self, seq_len: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables of shape (T, Dh), fp32, for positions start … start + seq_len − 1
        (`start` > 0: new tokens after those a KV cache holds)."""
        pos_T = torch.arange(start, start + seq_len, device=self.inv_freq.device, dtype=torch.float32)
        angles_TF = torch.outer(pos_T, self.inv_freq)
        angles_TD = torch.cat([angles_TF, angles_TF], dim=-1)
        if self.attention_factor != 1:
            return angles_TD.cos() * self.attention_factor, angles_TD.sin() * self.attention_factor
        return angles_TD.cos(), angles_TD.sin()


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    """Llama 3.1's scaled frequencies, by the operations of transformers' `_compute_llama3_parameters`
    (bit for bit): a wavelength over original / low_freq_factor is stretched by `factor`, one under
    original / high_freq_factor kept, one between blended, linear in original / wavelength."""
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = ~(wavelen < original / s.high_freq_factor) & ~(wavelen > original / s.low_freq_factor)
    return torch.where(between, blended, scaled)


def yarn_inv_freq(pos_freqs: torch.Tensor, theta: float, s: RopeScalingConfig) -> torch.Tensor:
    """YaRN's frequencies (`pos_freqs`: theta^(2i/dim)), by the operations of transformers'
    `_compute_yarn_parameters` (truncated correction range): the pairs' indices between those that
    turn beta_fast and beta_slow times in the original context ramp from kept to scaled by factor."""
    dim = 2 * pos_freqs.numel()

    def index(turns: float) -> float:  # the pair index that turns `turns` times in the original context
        return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(index(s.beta_fast)), 0), min(math.ceil(index(s.beta_slow)), dim - 1)
    high += 0.001 if low == high else 0
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = (1 - ramp).to(pos_freqs.device)
    return 1.0 / (s.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1·mscale·ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(s: RopeScalingConfig) -> float:
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_factor(s: RopeScalingConfig) -> float:
    """What multi-head latent attention's softmax scale is multiplied by (DeepSeek-V3's YaRN mscale_all_dim)."""
    return yarn_mscale(s.factor, s.mscale_all_dim) ** 2 if s.type == RopeScaling.yarn and s.mscale_all_dim else 1.0


def apply_rope(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    x = x_BHTD.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos_TD + rotated * sin_TD).to(x_BHTD.dtype)
