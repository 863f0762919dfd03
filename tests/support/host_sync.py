"""`forbid_host_sync()`: raise `HostSyncError` on anything that would stall the host on a device.

On CPU such calls are harmless, so the detector catches them by name (Python methods such as
`.item()`, `.tolist()`, `bool()`) and by op (the dispatcher, which also sees backward): ops that
read device data on the host, or whose output size is data (CUDA must sync to size it). The
sync-free dispatchers' tests run dispatch, combine and backward under it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncError(RuntimeError):
    """Code under `forbid_host_sync()` synchronized (or would synchronize) with the host."""


aten = torch.ops.aten
# Ops that read device data on the host, or whose output size is data (CUDA must sync to size it).
_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.is_nonzero.default,
}
_BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class _SyncOpDetector(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            raise HostSyncError(f"{func} synchronizes with the host")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size synchronizes with the host")
        if func in _BOOL_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            raise HostSyncError(f"{func} with a boolean mask has a data-dependent size")
        return func(*args, **kwargs)


def _raiser(name):
    def method(*args, **kwargs):
        raise HostSyncError(f"Tensor.{name} reads device data on the host")

    return method


def _to_without_device(original):
    def to(self, *args, **kwargs):
        if "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args):
            raise HostSyncError("Tensor.to(device) copies across devices")
        return original(self, *args, **kwargs)

    return to


@contextlib.contextmanager
def forbid_host_sync():
    """Raise HostSyncError on anything that would stall the host on a device (module docstring)."""
    names = ["item", "tolist", "cpu", "cuda", "numpy", "__bool__", "__int__", "__float__", "__index__"]
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(mock.patch.object(torch.Tensor, name, _raiser(name)))
        stack.enter_context(mock.patch.object(torch.Tensor, "to", _to_without_device(torch.Tensor.to)))
        stack.enter_context(_SyncOpDetector())
        yield
