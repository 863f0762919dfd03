"""The named axes of `ParallelDims` (src/moetrain/parallel/dims.py): each group's ranks follow the
rank formula's two factorizations, and a rank's `index` is its place among them."""

import pytest

from moetrain.parallel.dims import GROUPS, ParallelDims, ParallelState


@pytest.mark.parametrize("pp, dp, cp, ep", [(1, 4, 1, 2), (2, 2, 2, 4), (3, 2, 2, 2), (2, 4, 2, 1), (2, 3, 2, 6)])
def test_groups_follow_the_rank_formula(pp, dp, cp, ep):
    dims = ParallelDims(world_size=pp * dp * cp, dp=dp, ep=ep, pp=pp, cp=cp)
    R = dp * cp
    for rank in range(dims.world_size):
        p, r = divmod(rank, R)
        stage = tuple(range(p * R, (p + 1) * R))
        assert dims.ranks(rank, "dp", "cp") == dims.ranks(rank, "edp", "ep") == stage
        assert dims.ranks(rank, "cp") == tuple(range(rank - r % cp, rank - r % cp + cp))
        assert dims.ranks(rank, "ep") == tuple(range(rank - r % ep, rank - r % ep + ep))
        assert dims.ranks(rank, "edp") == tuple(p * R + e * ep + r % ep for e in range(dims.edp))
        assert dims.ranks(rank, "pp") == tuple(r + i * R for i in range(pp))
        assert dims.ranks(rank, "pp", "dp", "cp") == tuple(range(dims.world_size))
        indices = [dims.index(rank, axis) for axis in ("pp", "dp", "cp", "edp", "ep")]
        assert indices == [p, r // cp, r % cp, r // ep, r % ep]
        for axes in GROUPS + (("pp", "dp", "cp"), ("dp",)):
            assert dims.ranks(rank, *axes)[dims.index(rank, *axes)] == rank


def test_one_rank_has_no_groups():
    state = ParallelState(ParallelDims(world_size=1, dp=1, ep=1))
    assert all(state.group(*axes) is None for axes in GROUPS + (("pp", "dp", "cp"),))
    assert state.index("dp", "cp") == state.index("pp") == 0 and state.mesh is None
