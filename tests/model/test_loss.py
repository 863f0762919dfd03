"""The chunked LM loss (src/moetrain/model/loss.py) equals the plain head + cross-entropy: loss and
both gradients, in fp32 and under bf16 autocast, for chunks that divide the tokens and chunks
that do not; through the model's forward too."""

import pytest
import torch
import torch.nn.functional as F
from test_transformer import small_cfg

from moetrain.model.loss import linear_cross_entropy, lm_loss


def plain(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def grads(fn, h, w, t):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [7, 16, 64, 1000])
def test_chunked_equals_plain_in_fp32(chunk):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(64, 24, generator=g), torch.randn(50, 24, generator=g) * 0.3
    t = torch.randint(0, 50, (64,), generator=g)
    want = grads(plain, h, w, t)
    got = grads(lambda a, b, c: linear_cross_entropy(a, b, c, chunk), h, w, t)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-7)
    assert got[1].dtype == h.dtype and got[2].dtype == w.dtype


def test_chunked_equals_plain_under_bf16_autocast():
    """The products in bf16 (as autocast runs nn.Linear), softmax and loss in fp32: the same
    numbers as the plain path to bf16 rounding; the fp32 weight gets an fp32 gradient."""
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(96, 32, generator=g), torch.randn(80, 32, generator=g) * 0.2
    t = torch.randint(0, 80, (96,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = grads(plain, h, w, t)
        got = grads(lambda a, b, c: linear_cross_entropy(a, b, c, 40), h, w, t)
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-4)
    assert got[2].dtype == torch.float32


def test_without_grad_only_the_loss_is_computed():
    h, w, t = torch.randn(10, 8), torch.randn(12, 8), torch.randint(0, 12, (10,))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, 4)
    torch.testing.assert_close(loss, plain(h, w, t), rtol=1e-6, atol=1e-6)


def test_the_models_loss_is_the_same_chunked_or_not():
    cfg = small_cfg(n_layers=2, num_dense_layers=1)
    model = cfg.build()
    model.init_weights(seed=0)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    results = []
    for chunk in (0, 5):
        model.zero_grad(set_to_none=True)
        loss = model(inputs, targets_BT=targets, loss_chunk_tokens=chunk)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (chunked_loss, chunked_grads) = results
    torch.testing.assert_close(chunked_loss, plain_loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # chunk_tokens = 0 is the plain path itself, bit for bit
    h = torch.randn(1, 3, 32)
    assert torch.equal(
        lm_loss(model.lm_head, h, targets[:1, :3], 0),
        F.cross_entropy(model.lm_head(h).float().flatten(0, 1), targets[:1, :3].flatten()),
    )
