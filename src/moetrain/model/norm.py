"""RMSNorm: x / rms(x) * weight, computed in fp32 whatever the input dtype; the token embedding,
normalized or not."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics: in bf16 the mean of squares loses too many bits on wide rows.
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Embedding(nn.Embedding):
    """The token embedding, then × √dim and `norm` where given (model.embedding_norm, Olmo-core's
    `embed_scale` and `embedding_norm`): its parameters are `weight` and `norm.weight`, so every
    caller (the model, a pipeline's first stage, the multi-token prediction's shifted embeddings)
    embeds the same way."""

    def __init__(self, vocab_size: int, dim: int, norm: RMSNorm | None = None):
        super().__init__(vocab_size, dim)
        self.norm = norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)
        return x if self.norm is None else self.norm(x * self.embedding_dim**0.5)
