"""Muon (`optim.name=muon`): the matrices inside the blocks step along the orthogonalized
momentum of their gradient; everything else keeps AdamW.

Legend: W an (m, n) matrix, G its gradient (reduced over the data-parallel ranks and clipped),
M its momentum, β optim.muon_momentum, k optim.muon_ns_steps.

Per matrix and step (Nesterov momentum, decoupled weight decay as AdamW's):

    M ← β·M + G
    U = G + β·M
    O = NS_k(U)                                the Newton–Schulz iteration below: U's singular
                                               vectors with its singular values pushed to ≈ 1
    W ← W − lr·(0.2·√max(m, n)·O + wd·W)

Scaling rule: O has RMS ≈ 1/√max(m, n) (min(m, n) singular values near 1), so 0.2·√max(m, n)·O
has RMS ≈ 0.2, the RMS of a typical AdamW update. The matrices then take the run's AdamW
learning rate and weight decay (the rule Moonlight's "Muon is Scalable for LLM Training"
gives): `optim.lr` and `optim.weight_decay` serve both.

Which matrices (`muon_matrices`): every `nn.Linear` weight inside the blocks and each routed
expert's matrices, one expert at a time, its gate and up halves apart. AdamW keeps the embedding,
the norms, the routers (their few rows decide routing) and the LM head.

Newton–Schulz (`newton_schulz`): X = U / ‖U‖_F, then k times X ← a·X + (b·A + c·A²)·X with
A = X·Xᵀ (a tall X: the same on Xᵀ), (a, b, c) = (3.4445, −4.7750, 2.0315), the quintic of
Keller Jordan's Muon, which drives singular values in (0, 1] to [0.7, 1.2] in 5 steps. It runs in
bf16 on CUDA and in fp32 elsewhere; on CUDA a wide matrix of 1,024 rows or more computes A and
b·A + c·A² one triangle each (`symmetric_product`, src/moetrain/optim/triton_kernels.py).

Where a matrix is sharded, the iteration needs it whole: one `Muon` steps every layout, each
optimizer handing it the parts it holds (`LocalMatrices`) and how to gather a part's direction
whole. The momentum is kept where the gradient is: whole, or as the rank's shard.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.experts import GroupedExperts

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic's (a, b, c)."""

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

TRIANGLE_MIN_ROWS = 1024
"""The fewest rows of a wide matrix whose Newton–Schulz products run one triangle at a time on CUDA."""

RMS_MATCH = 0.2
"""The RMS of a Muon update before the learning rate (see the module docstring)."""


def newton_schulz(u_kMN: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalize each (M, N) matrix of the batch `u_kMN`: the same singular vectors, singular
    values near 1. Computed and returned in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = u_kMN.to(dtype)
    x = x if x.ndim == 3 else x.unsqueeze(0)
    x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).to(dtype)
    # A on the short side: X·Xᵀ (M ≤ N) or Xᵀ·X (tall); b·A + c·A² and a·X + B·X (X·B) as the
    # GEMMs' epilogues (baddbmm), so no element-wise pass and no transposed copy
    tall = x.shape[-2] > x.shape[-1]
    # A and B one triangle each where it was measured faster (bf16 on an H100, S ≥ 1,024 rows not
    # longer than the columns: 1.18-1.36x the iteration, the same bits; docs/measurements.md)
    triangle = x.is_cuda and dtype == torch.bfloat16 and TRIANGLE_MIN_ROWS <= x.shape[-2] <= x.shape[-1]
    if triangle:
        from moetrain.optim.triton_kernels import symmetric_product
    for _ in range(steps):
        if triangle:
            a_kSS = symmetric_product(x.contiguous(), 1.0, None, 0.0)
            b_kSS = symmetric_product(a_kSS, c, a_kSS, b)
        else:
            a_kSS = x.mT @ x if tall else x @ x.mT
            b_kSS = torch.baddbmm(a_kSS, a_kSS, a_kSS, beta=b, alpha=c)
        x = torch.baddbmm(x, x, b_kSS, beta=a) if tall else torch.baddbmm(x, b_kSS, x, beta=a)
    return x.reshape(u_kMN.shape)


@dataclasses.dataclass(frozen=True)
class MatrixShape:
    """How a parameter is a batch of matrices: `count` matrices of (rows, cols), in row-major
    order of the parameter's elements (each matrix contiguous in it)."""

    count: int
    rows: int
    cols: int

    @property
    def scale(self) -> float:
        """0.2 · √max(rows, cols): the update's RMS near AdamW's."""
        return RMS_MATCH * max(self.rows, self.cols) ** 0.5

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def muon_matrices(model: nn.Module) -> dict[int, MatrixShape]:
    """id → `MatrixShape` of each parameter Muon updates (module docstring; the multi-token
    prediction modules' included). A model without `blocks` (a test's plain module) gives every
    `nn.Linear` weight."""
    roots = [getattr(model, "blocks", model)] + ([model.mtp] if getattr(model, "mtp", None) is not None else [])
    out: dict[int, MatrixShape] = {}
    for module in (m for root in roots for m in root.modules()):
        if isinstance(module, nn.Linear):
            rows, cols = module.weight.shape
            out[id(module.weight)] = MatrixShape(1, rows, cols)
        elif isinstance(module, GroupedExperts):
            E, two_f, d = module.w_gate_up_E2FD.shape
            out[id(module.w_gate_up_E2FD)] = MatrixShape(2 * E, two_f // 2, d)  # gate and up apart
            E, d, f = module.w_down_EDF.shape
            out[id(module.w_down_EDF)] = MatrixShape(E, d, f)
    return out


def check_matrices(named: list[tuple[str, torch.Tensor]], shapes: dict[int, MatrixShape]) -> None:
    """Every parameter handed to Muon is a batch of matrices: refuse a 1-D one by name."""
    for name, p in named:
        if p.ndim < 2 or id(p) not in shapes:
            raise ValueError(
                f"Muon orthogonalizes matrices; '{name}' has shape {tuple(p.shape)}: give it to AdamW "
                "(norms, biases, embeddings and routers stay there: src/moetrain/optim/muon.py)."
            )


@dataclasses.dataclass
class MuonConfig:
    """The update's hyperparameters (optim.muon_momentum, optim.muon_ns_steps, optim.weight_decay)."""

    momentum: float
    ns_steps: int
    weight_decay: float

    @classmethod
    def of(cls, cfg: OptimConfig) -> MuonConfig:
        return cls(cfg.muon_momentum, cfg.muon_ns_steps, cfg.weight_decay)


def momentum_direction(
    m: torch.Tensor,
    g: torch.Tensor,
    beta: float,
    coef: torch.Tensor | None,
    skip: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """M ← β·M + c·G in place (c: the clipping factor, or 1), unchanged where `skip`; returns
    U = c·G + β·M (computed in fp32, rounded once to `dtype`: the iteration's), the direction
    Newton–Schulz orthogonalizes. On CUDA one compiled kernel (reads M and G, writes M and U)."""
    fn = _compiled(_momentum_direction) if m.is_cuda else _momentum_direction
    return fn(m.view(-1), g.reshape(-1), beta, coef, skip, dtype).view(m.shape)


def _momentum_direction(m, g, beta, coef, skip, dtype):
    g32 = g.float() if coef is None else g.float() * coef
    new_m = m.float() * beta + g32
    if skip is not None:
        new_m = torch.where(skip, m.float(), new_m)
    m.copy_(new_m)
    return (g32 + beta * new_m).to(dtype)


def apply_update(
    w: torch.Tensor, o: torch.Tensor, scale: float, lr: float, weight_decay: float, skip: torch.Tensor | None
) -> None:
    """W ← W·(1 − lr·wd) − lr·scale·O in place (fp32 arithmetic on any `o` dtype), unchanged where
    `skip`. On CUDA one compiled kernel."""
    fn = _compiled(_apply_update) if w.is_cuda else _apply_update
    fn(w.view(-1), o.reshape(-1), scale, lr, weight_decay, skip)


def _apply_update(w, o, scale, lr, weight_decay, skip):
    new_w = w.float() * (1 - lr * weight_decay) - (lr * scale) * o.float()
    if skip is not None:
        new_w = torch.where(skip, w.float(), new_w)
    w.copy_(new_w)


@functools.cache
def _compiled(fn):
    """`fn` through torch.compile, sizes dynamic (every matrix's flat elements take one graph;
    the float arguments are graph inputs, not constants): one fused kernel instead of the
    element-wise ops' passes over fp32 state (measured: benchmarks/probes/muon_step_probe.py)."""
    return torch.compile(fn, dynamic=True)


@dataclasses.dataclass
class LocalMatrices:
    """This rank's part of one parameter Muon steps: elements [start, start + target.numel()) of
    the parameter's row-major elements (all of them where the rank holds it whole)."""

    shape: MatrixShape
    """The parameter's matrices (the part's, where no rank gathers the rest: FSDP's experts)."""
    target: torch.Tensor
    """The values this rank updates: the parameter, its shard, or its master's shard."""
    momentum: torch.Tensor
    """M of those values."""
    start: int = 0
    group: dist.ProcessGroup | None = None
    """The ranks that hold the whole direction alike and share out its orthogonalization."""


class Muon:
    """Muon's update (module docstring) over the parts of its matrices a rank holds (`parts`):
    the momentum and the update on the part, Newton–Schulz on whole matrices.

    Each optimizer hands over its parts and `gather`: each part's direction U → the parameter's
    whole U, flat (the replicated optimizer's parts are whole: none; the sharded one all-gathers
    its buckets, FSDP its row-sharded matrices). A parameter whose whole U a group of ranks holds
    alike has its matrices orthogonalized once across the group: its matrices are cut into
    contiguous runs (`_Share`), each run given to one rank (the least loaded by Newton–Schulz's
    work, m·n·min(m, n) a matrix), and the results all-gathered in the iteration's dtype. Every
    rank computes the same O a lone rank would, so neither the layout nor the division changes a
    number."""

    def __init__(self, cfg: MuonConfig, parts: list[LocalMatrices], gather=None):
        self.cfg, self.parts, self.gather = cfg, parts, gather
        groups = [x.group for x in parts]
        shapes = [x.shape for x in parts]
        unique = {id(g): g for g in groups}.values()  # process groups compare by identity
        self.shares = [_Share(g, [i for i, pg in enumerate(groups) if pg is g], shapes) for g in unique]
        """Per group of ranks (None: this rank alone), who orthogonalizes which matrices."""
        cuda = any(x.target.is_cuda for x in parts)
        self.dtype = torch.bfloat16 if cuda else torch.float32
        """The iteration's dtype: bf16 on CUDA, fp32 elsewhere (the CPU tests compare layouts in fp32)."""

    @classmethod
    def whole(cls, named: list[tuple[str, nn.Parameter]], shapes: dict[int, MatrixShape], cfg: MuonConfig, *,
              moments_dtype: torch.dtype = torch.float32, groups: list | None = None) -> Muon:  # fmt: skip
        """Over parameters this rank holds whole; `groups`: per parameter, the ranks that hold it
        alike (the data-parallel replicas of the dense ones, the expert-replica group of the experts)."""
        check_matrices(named, shapes)
        groups = groups or [None] * len(named)
        parts = [
            LocalMatrices(shapes[id(p)], p, torch.zeros_like(p, dtype=moments_dtype), group=g)
            for (_, p), g in zip(named, groups)
        ]
        return cls(cfg, parts)

    @property
    def momentum(self) -> list[torch.Tensor]:
        return [x.momentum for x in self.parts]

    @torch.no_grad()
    def step(
        self, grads: list[torch.Tensor | None], lr: float, coef: torch.Tensor | None, skip: torch.Tensor | None
    ) -> None:
        """One update of every part from its gradient in `grads` (same order, the part's elements;
        None: no gradient this step, no update, as AdamW skips it)."""
        directions = [
            None if g is None else momentum_direction(x.momentum, g, self.cfg.momentum, coef, skip, self.dtype)
            for x, g in zip(self.parts, grads)
        ]
        whole = directions if self.gather is None else self.gather(directions)
        for share in self.shares:
            for i, o in share.orthogonalized(whole, self.cfg.ns_steps):
                x = self.parts[i]
                piece = o.reshape(-1)[x.start : x.start + x.target.numel()]
                apply_update(x.target, piece, x.shape.scale, lr, self.cfg.weight_decay, skip)

    def memory_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.momentum)


class _Share:
    """One group's division of Newton–Schulz (`Muon`): parameters `indices` of `shapes`,
    each cut into at most `size` contiguous runs of its matrices, the runs dealt out (largest
    first) to the rank with the least work so far; every rank computes this deal alike."""

    def __init__(self, group, indices: list[int], shapes: list[MatrixShape]):
        self.group, self.shapes = group, shapes
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        runs = []  # (work, param index, first matrix, matrices)
        for i in indices:
            s = shapes[i]
            pieces = min(s.count, self.size)
            for k in range(pieces):
                first, last = k * s.count // pieces, (k + 1) * s.count // pieces
                runs.append((s.numel * min(s.rows, s.cols) * (last - first), i, first, last - first))
        load = [0] * self.size
        self.runs: list[list[tuple[int, int, int]]] = [[] for _ in range(self.size)]
        """Per rank: (param index, first matrix, matrices) in the order its results are laid out."""
        for work, i, first, n in sorted(runs, key=lambda r: (-r[0], r[1], r[2])):
            owner = load.index(min(load))
            load[owner] += work
            self.runs[owner].append((i, first, n))

    def orthogonalized(self, directions: list[torch.Tensor | None], steps: int):
        """(param index, O) for each of the group's parameters with a direction (a gradient this
        step): alone, each computed here; in a group, each rank's runs computed by it and
        all-gathered. A parameter without a gradient has none on any rank (they hold it alike),
        so every rank leaves the same runs out."""
        if self.size == 1:
            for i, _, _ in self.runs[0]:
                if directions[i] is not None:
                    yield i, newton_schulz(self._batch(directions[i], i), steps, directions[i].dtype)
            return
        runs = [[(i, f, n) for i, f, n in r if directions[i] is not None] for r in self.runs]
        if not any(runs):
            return
        lengths = [[n * self.shapes[i].numel for i, _, n in r] for r in runs]
        like = directions[next(r[0][0] for r in runs if r)]
        out = like.new_zeros(self.size, max(map(sum, lengths)))
        if runs[self.rank]:
            pieces = [
                newton_schulz(self._batch(directions[i], i)[f : f + n], steps, like.dtype).reshape(-1)
                for i, f, n in runs[self.rank]
            ]
            torch.cat(pieces, out=out[self.rank, : sum(lengths[self.rank])])
        _all_gather(out.view(-1), out[self.rank].clone(), group=self.group)
        parts: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for r, (rank_runs, rank_lengths) in enumerate(zip(runs, lengths)):
            for (i, f, _), o in zip(rank_runs, out[r, : sum(rank_lengths)].split(rank_lengths)):
                parts.setdefault(i, []).append((f, o))
        for i in sorted(parts):
            yield i, torch.cat([o for _, o in sorted(parts[i], key=lambda part: part[0])])

    def _batch(self, u: torch.Tensor, i: int) -> torch.Tensor:
        s = self.shapes[i]
        return u.view(s.count, s.rows, s.cols)
