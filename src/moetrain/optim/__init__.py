"""Optimizers: one per parallel stack, all behind `Optimizer` (src/moetrain/optim/base.py).

- `ReplicatedAdamW` (replicated.py): torch AdamW, full state on every rank; with dp > 1 the
  ddp stack's gradient reduction (`GradReducer`, grad_reducer.py)
- `ShardedAdamW` (sharded.py, `parallel.shard_optimizer=true`): AdamW state and fp32 master
  weights sharded over the data-parallel ranks; gradients reduce-scattered
- `FSDPAdamW` (fsdp.py, `parallel.stack=fsdp`): torch AdamW over FSDP's sharded parameters

Each steps its parameters by an element-wise update rule (rule.py: adamw.py, lion.py), and the
blocks' matrices by Muon with optim.name=muon (muon.py). `OptimConfig.build` (config.py) picks the
one the layout needs.
"""
