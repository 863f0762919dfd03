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


def test_the_fp8_head_takes_fp8_logits_and_input_gradient():
    """train.fp8_lm_head's chunked products: the logits are `fp8_linear`'s (the same quantized
    operands), so the loss is the plain FP8 head's; the hidden states' gradient is an FP8 product
    within FP8's error of the exact one, and the weight's gradient, not an FP8 product, is nearer
    the exact one than the plain FP8 path's (whose three products are all FP8)."""
    from moetrain.model.fp8 import fp8_linear

    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(96, 32, generator=g), torch.randn(80, 32, generator=g) * 0.2
    t = torch.randint(0, 80, (96,), generator=g)
    fp8_plain = grads(lambda a, b, c: F.cross_entropy(fp8_linear(a, b).float(), c), h, w, t)
    chunked = grads(lambda a, b, c: linear_cross_entropy(a, b, c, 40, fp8=True), h, w, t)
    exact = grads(plain, h, w, t)
    torch.testing.assert_close(chunked[0], fp8_plain[0], rtol=1e-6, atol=1e-6)
    assert chunked[0] != exact[0]  # the logits were FP8 products
    assert abs(float(chunked[0] - exact[0])) < 0.02 * float(exact[0])

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(chunked[1], exact[1]) < 0.08 and rel(chunked[1], fp8_plain[1]) < 0.05
    assert rel(chunked[2], exact[2]) < 0.25 * rel(fp8_plain[2], exact[2])
    assert chunked[1].dtype == h.dtype and chunked[2].dtype == w.dtype
