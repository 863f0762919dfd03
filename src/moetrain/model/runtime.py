"""What training tells the model's layers as they run, one object the model owns and its layers share
(`Transformer.runtime`): set by the trainer (src/moetrain/train/engine.py) and recompute (`checkpoint`)."""

from dataclasses import dataclass

import torch.utils.checkpoint

from moetrain.model.expert_grads import DeferredExpertGrads


@dataclass(eq=False)
class ModelRuntime:
    backward_scale: float = 1.0
    """Every backward's LM loss factor, and so the gradient of the losses attached to activations."""
    expert_grads: DeferredExpertGrads | None = None
    """The expert weight gradients computed once a step (`compute.defer_expert_weight_grad`)."""
    recomputing: bool = False
    """True while activation recompute re-runs a block's forward inside backward (`checkpoint`)."""

    def checkpoint(self, fn, *args, **kwargs):
        """torch.utils.checkpoint (non-reentrant) of a block, `recomputing` while backward re-runs it. Asking
        autograd whether a backward runs is a graph break under torch.compile: asked here, not in the layers."""

        def run(*fn_args, **fn_kwargs):
            self.recomputing = torch._C._current_graph_task_id() != -1  # private, as torch.utils.checkpoint's
            try:
                return fn(*fn_args, **fn_kwargs)
            finally:
                self.recomputing = False

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)
