"""The fused permutation (src/moetrain/model/permute.py) against the plain autograd formulation it
replaces: index_select into expert order, index_copy back, multiply by the top-k weights, sum
over k."""

import pytest
import torch
from support.steps import fused_permute_combine, plain_permute_combine, routed_case

from moetrain.model.permute import inverse_permutation

N, K, D = 96, 4, 24
plain, fused = plain_permute_combine, fused_permute_combine


def routed(seed, skew=False):
    return routed_case(seed, N, K, D, skew=skew)


def expert_stand_in(x_MD):
    # Row-dependent, nonlinear: a wrong row order or a wrong gradient row shows.
    scale = torch.arange(1, x_MD.shape[0] + 1, dtype=x_MD.dtype).unsqueeze(1) / x_MD.shape[0]
    return torch.tanh(x_MD) * scale + x_MD.square() * 0.01


def run(fn, ids, x, w, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, ids, w, expert_stand_in)
    gx, gw = torch.autograd.grad(y, [x, w], grad)
    return y, gx, gw


def test_inverse_permutation():
    p = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    inv = inverse_permutation(p)
    assert torch.equal(inv[p], torch.arange(1000)) and torch.equal(p[inv], torch.arange(1000))


@pytest.mark.parametrize("skew", [False, True])
def test_fp32_equals_the_plain_formulation_bit_for_bit(skew):
    ids, x, w, grad = routed(1, skew)
    for a, b, name in zip(run(plain, ids, x, w, grad), run(fused, ids, x, w, grad), ("y", "grad x", "grad w")):
        assert torch.equal(a, b), name


def test_compiled_matches_eager():
    ids, x, w, grad = routed(2)
    eager = run(fused, ids, x, w, grad)
    compiled = run(torch.compile(fused, fullgraph=True), ids, x, w, grad)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bf16_rows_fp32_router_gradient():
    """bf16 expert rows (as under autocast): the output is bf16, the weights' gradient fp32 and
    summed in fp32 (closer to the fp32 result than the bf16-rounded products would be)."""
    ids, x, w, grad = routed(3)

    def f(x_MD):
        return x_MD.to(torch.bfloat16)

    x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fused(x_, ids, w_, f)
    assert y.dtype == torch.bfloat16
    gx, gw = torch.autograd.grad(y, [x_, w_], grad.to(torch.bfloat16))
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32
    # Reference in float64 from the same bf16 values.
    xb, gb = x.to(torch.bfloat16).double(), grad.to(torch.bfloat16).double()
    ref_gw = torch.einsum("nd,nd->n", gb, xb).unsqueeze(1).expand(N, K)
    assert (gw.double() - ref_gw).abs().max() <= 1e-5 * ref_gw.abs().max()
