"""RMSNorm: x / rms(x) * weight, computed in fp32 whatever the input dtype."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: in bf16 the mean of squares loses too many bits on wide rows.
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
