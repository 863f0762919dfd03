"""Rotary position embeddings (RoPE), "rotate-half" convention (as Llama/Qwen in HF).

Legend: B batch, T sequence, H heads, Dh head dim.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # Not persistent: derived from the config, rebuilt by init_weights (works after meta init).
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)

    def init_weights(self) -> None:
        with torch.no_grad():
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
            self.inv_freq.copy_(1.0 / (self.theta ** (exponents / self.head_dim)))

    def cos_sin(self, seq_len: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables of shape (T, Dh), fp32, for positions start … start + seq_len − 1
        (`start` > 0: new tokens after those a KV cache holds)."""
        pos_T = torch.arange(start, start + seq_len, device=self.inv_freq.device, dtype=torch.float32)
        angles_TF = torch.outer(pos_T, self.inv_freq)
        angles_TD = torch.cat([angles_TF, angles_TF], dim=-1)
        return angles_TD.cos(), angles_TD.sin()


def apply_rope(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    x = x_BHTD.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos_TD + rotated * sin_TD).to(x_BHTD.dtype)
