"""Everything applied to the model from outside: activation recompute and compilation now;
expert/data/pipeline parallelism are added here, in the fixed order of `parallelize`."""

from moetrain.parallel.parallelize import parallelize

__all__ = ["parallelize"]
