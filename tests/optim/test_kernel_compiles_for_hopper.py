"""The Triton kernels of src/moetrain/optim/triton_kernels.py (AdamW, gradient accumulation)
compile ahead of time for Hopper (sm_90: PTX, then a cubin through the ptxas Triton ships) in
every specialization the optimizers launch, here on a machine without a GPU; their numerics are
checked in the interpreter
(tests/optim/test_split_master.py, test_moments_bf16.py) and on the GPU (tests/gpu/test_cuda.py)."""

import pytest

triton = pytest.importorskip("triton")


@pytest.mark.parametrize(
    "split, low_moments, grad, coef, skip",
    [
        (True, False, "*fp32", True, True),  # bf16 weights (SplitMaster, sharded split buckets)
        (True, False, "*bf16", True, False),  # a step's first backward: the bf16 gradient kept
        (True, True, "*bf16", False, True),  # bf16 weights and bf16 moments
        (False, True, "*fp32", True, True),  # fp32 parameters, bf16 moments (RuleOptimizer)
        (False, True, "*fp32", False, False),
    ],
)
def test_adamw_kernel_compiles_for_sm90(split, low_moments, grad, coef, skip):
    from triton.backends.compiler import GPUTarget

    from moetrain.optim.triton_kernels import BLOCK, _adamw_kernel

    signature = {
        "p_ptr": "*i16" if split else "*fp32",
        "lo_ptr": "*i16" if split else "*fp32",
        "grad_ptr": grad,
        "m_ptr": "*i16" if low_moments else "*fp32",
        "v_ptr": "*i16" if low_moments else "*fp32",
        "corr_ptr": "*fp32",
        "coef_ptr": "*fp32",
        "skip_ptr": "*i1" if skip else "*fp32",
        "n": "i64",
        **dict.fromkeys(("beta1", "beta2", "eps", "decay"), "fp32"),
        **dict.fromkeys(("SPLIT", "LOW_MOMENTS", "HAS_COEF", "HAS_SKIP", "BLOCK"), "constexpr"),
    }
    values = {"SPLIT": split, "LOW_MOMENTS": low_moments, "HAS_COEF": coef, "HAS_SKIP": skip, "BLOCK": BLOCK}
    names = list(signature)
    source = triton.compiler.ASTSource(
        fn=_adamw_kernel, signature=signature, constexprs={(names.index(k),): v for k, v in values.items()}
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in kernel.asm["ptx"] and len(kernel.asm["cubin"]) > 1000


@pytest.mark.parametrize("acc", ["*bf16", "*fp32"])
def test_gradient_accumulation_kernel_compiles_for_sm90(acc):
    """The second backward's (bf16 + bf16 → new fp32) and the later ones' (fp32 += bf16)."""
    from triton.backends.compiler import GPUTarget

    from moetrain.optim.triton_kernels import ACC_BLOCK, _accumulate_kernel

    signature = {"acc_ptr": acc, "grad_ptr": "*bf16", "out_ptr": "*fp32", "n": "i64", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(fn=_accumulate_kernel, signature=signature, constexprs={(4,): ACC_BLOCK})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert ".target sm_90" in kernel.asm["ptx"] and len(kernel.asm["cubin"]) > 1000
