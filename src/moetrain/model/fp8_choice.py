"""Which matrix products run in row-wise FP8: those whose shape repays FP8's fixed cost.

Legend: M rows a product multiplies per call (tokens of a micro-batch on this rank; for the
experts, token-expert assignments), K its reduction dim, N its output features, E experts.

An FP8 product saves a share of its GEMMs' time but pays a cost that does not shrink with it:
its quantizers' passes and, above all, the host time of an eager island in a compiled block
(each FP8 product is one: src/moetrain/model/fp8.py), about 1.6 ms per linear's forward and backward
on the H200 machine, against 0.3 ms of device time at 8192 × 4096 × 4096. A grouped GEMM with
few rows per expert gains little from FP8 tensor cores as well. Measured product by product
(`benchmarks/probes/fp8_choice_probe.py`, docs/measurements.md "FP8, product by product"), FP8
pays where a product's forward and backward multiply at least `MIN_TFLOP` of its kind and, for
the experts, each expert gets at least `MIN_ROWS_PER_EXPERT` rows; below either, it costs time.
The LM head is judged as a linear of its shape (`choose_head`) unless `precision.fp8_lm_head` is set. The choice
depends on the configuration only (not on the device or a timing), so a run, its resume and its
CPU emulation make the same one.
"""

from __future__ import annotations

import dataclasses
import enum

from moetrain.model.counting import block_matrices

MIN_TFLOP = {"linear": 0.8, "experts": 2.0}
"""Forward-and-backward TFLOP of one call below which an FP8 product loses time, by kind: a
linear's 0.8 pays inside bench-8e's model though not alone, while an expert layer, with more fixed
cost per call, needs 2 (docs/measurements.md, "FP8, product by product")."""

MIN_ROWS_PER_EXPERT = 2048
"""Mean rows per expert below which the FP8 expert layer does not pay (the probe: 4096 rows gave
1.28×, 1024 rows 1.08× alone and a slower model step)."""


class Fp8Select(enum.StrEnum):
    """Which products `precision.fp8` turns to FP8 (`precision.fp8_select`)."""

    auto = "auto"
    """Those whose shape repays it (src/moetrain/model/fp8_choice.py): on the bench presets all
    but the attention's k/v of bench-8e and the dense MLP of bench-tiny64e-l6; none of a small
    model's."""
    all = "all"
    """Every expert layer and every linear layer in the blocks but the router, whatever its shape:
    for numerics studies (the recipe's loss on a small model) and timing every product."""


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product of a step and its forward-and-backward FLOPs per call."""

    kind: str
    """"linear" (x (M, K) · w (N, K)ᵀ) or "experts" (a SwiGLU expert layer: gate/up K → 2N, down
    N → K, as grouped GEMMs over E experts)."""
    M: int
    K: int
    N: int
    E: int = 1

    @property
    def tflop(self) -> float:
        return 6 * self.M * self.K * self.N * (3 if self.kind == "experts" else 1) / 1e12

    @property
    def pays(self) -> bool:
        """Whether row-wise FP8 is measured to make this product faster (module docstring)."""
        rows_pay = self.kind != "experts" or self.M / self.E >= MIN_ROWS_PER_EXPERT
        return self.tflop >= MIN_TFLOP[self.kind] and rows_pay


def choose(product: Product, select: Fp8Select | str) -> bool:
    """Whether `product` runs in FP8 under `select`."""
    return Fp8Select(select) == Fp8Select.all or product.pays


def block_products(cfg, rows: int) -> dict[str, Product]:
    """The kinds of product in the blocks of a `TransformerConfig`, by name, at `rows` tokens per
    micro-batch on a rank (experts: their mean rows over all experts, as balanced routing and any
    expert-parallel layout give each)."""
    return {name: product for name, (product, _) in _products(cfg, rows).items()}


def _products(cfg, rows: int) -> dict[str, tuple[Product, int]]:
    """`block_products` with each one's calls in the model's blocks: the blocks' declared matrices
    (`counting.block_matrices`), an expert layer one call of its three grouped GEMMs."""
    out = {}
    for moe_block, layers in ((False, cfg.num_dense_layers), (True, cfg.num_moe_layers)):
        for x in block_matrices(cfg, moe_block) if layers else ():
            k = cfg.moe.top_k if x.experts else 1
            product = Product("experts" if x.experts else "linear", rows * k, x.d_in, x.d_out, x.experts or 1)
            out[x.name] = (product, out.get(x.name, (product, 0))[1] + layers * x.copies)
    return out


def choose_head(cfg, rows: int, select: Fp8Select | str, asked: bool | None = None) -> bool:
    """Whether the LM head runs in FP8: `asked` (precision.fp8_lm_head) when set; else where `select`
    would take a block product of its shape and the vocabulary is a multiple of 16 (what the FP8
    kernels take)."""
    if asked is not None:
        return asked
    head = Product("linear", rows, cfg.d_model, cfg.vocab_size)  # hidden states (M, D) · the vocabulary's (V, D)ᵀ
    return cfg.vocab_size % 16 == 0 and choose(head, select)


def chosen_products(cfg, rows: int, select: Fp8Select | str) -> list[str]:
    """The names of the kinds of block product `select` takes."""
    return [name for name, p in block_products(cfg, rows).items() if choose(p, select)]


def describe(cfg, rows: int, select: Fp8Select | str) -> str:
    """Which kinds of product run in FP8, for the start-up line."""
    products = block_products(cfg, rows)
    chosen = chosen_products(cfg, rows, select)
    if Fp8Select(select) == Fp8Select.all:
        return "every product in the blocks (precision.fp8_select=all)"
    if not chosen:
        return "no product: all are too small to repay it (precision.fp8_select=auto)"
    rest = "the others are too small to repay it"
    return f"{', '.join(chosen)} ({len(chosen)} of {len(products)} kinds of product; {rest})"


def fp8_flops_per_token(cfg, rows: int, select: Fp8Select | str, lm_head: bool | None = None) -> tuple[float, float]:
    """(training FLOPs per token of the products that run in FP8, of all the blocks' products and
    the LM head's) at `rows` tokens per micro-batch: what the planner runs at the FP8 rate
    (src/moetrain/plan/time.py). `lm_head`: precision.fp8_lm_head, as `choose_head` takes it (an
    FP8 LM head runs its two FP8 products; the weight gradient stays bf16)."""
    chosen = every = 0.0
    for product, calls in _products(cfg, rows).values():
        flops = calls * product.tflop * 1e12 / rows
        every += flops
        chosen += flops if choose(product, select) else 0.0
    every += 6 * cfg.d_model * cfg.vocab_size
    chosen += 4 * cfg.d_model * cfg.vocab_size if choose_head(cfg, rows, select, lm_head) else 0.0
    return chosen, every
