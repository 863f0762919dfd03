"""Everything applied to the model from outside: the layout (config.py, dims.py), process groups
(distributed.py), expert parallelism (expert_parallel.py and the dispatchers:
exact_dispatchers.py, nosync_dispatcher.py, overlapped_dispatcher.py),
context parallelism (context_parallel.py), pipelines (pipeline.py), the FSDP2 stack (fsdp.py),
rehearsal's stand-in peers (rehearsal.py), and `parallelize` (parallelize.py), which applies them
in a fixed order. The data-parallel gradient reduction belongs to the optimizers
(src/moetrain/optim/grad_reducer.py)."""
