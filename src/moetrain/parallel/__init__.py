"""Everything applied to the model from outside: the layout (dims.py), process groups
(distributed.py), expert parallelism (expert_parallel.py), data-parallel gradient reduction
(data_parallel.py), and `parallelize` (parallelize.py), which applies them in a fixed order."""
