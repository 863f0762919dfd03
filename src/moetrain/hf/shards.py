"""Sharded safetensors, written one tensor at a time (Hugging Face's layout).

A model of `total` bytes is split in file order into shards of at most `max_shard_size` bytes
(a tensor larger than that gets a shard of its own): one file `model.safetensors`, or
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` ({"metadata":
{"total_size", "total_parameters"}, "weight_map": {name: file}}), as transformers'
`save_pretrained` writes them and `from_pretrained` reads them.

`ShardWriter` writes a file in the safetensors format itself: the header (names, dtypes, shapes,
offsets) is known from the plan before any value is, so each tensor is appended as it comes
and then dropped. `safetensors.torch.save_file` needs the whole file's tensors at once (and
copies them into bytes), which would hold a shard two or three times over.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from pathlib import Path

import torch

from moetrain.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

Spec = tuple[str, torch.dtype, tuple[int, ...]]
"""(name, dtype, shape) of one tensor of a file."""


def parse_size(text: str | int) -> int:
    """ "5GB" → 5·10⁹ bytes, "500MiB" → 500·2²⁰ (transformers' convention), or a plain integer."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if unit not in _UNITS:
            raise ConfigError(
                f"--max-shard-size={text!r} is not a size: give a number of bytes or one with a unit "
                "(KB, MB, GB or KiB, MiB, GiB), e.g. 5GB."
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"--max-shard-size={text!r} must be positive, e.g. 5GB.")
    return value


def nbytes(spec: Spec) -> int:
    _, dtype, shape = spec
    return math.prod(shape) * dtype.itemsize


def split_into_shards(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    """Consecutive groups of `specs` of at most `max_bytes` each (a larger tensor alone)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        n = nbytes(spec)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def shard_names(count: int) -> list[str]:
    return [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_json(shards: list[list[Spec]], names: list[str], parameters: int) -> dict:
    return {
        "metadata": {"total_size": sum(nbytes(s) for shard in shards for s in shard), "total_parameters": parameters},
        "weight_map": {spec[0]: name for shard, name in zip(shards, names) for spec in shard},
    }


def remove_stale(out: Path, keep: list[str]) -> None:
    """Safetensors files of an earlier export into `out` that this one does not write."""
    for path in out.iterdir():
        if (path.name == SINGLE or path.name == INDEX or SHARD_NAME.match(path.name)) and path.name not in keep:
            path.unlink()


class ShardWriter:
    """One safetensors file written in `specs` order, one `write` per tensor; complete (renamed
    from NAME.tmp) at `close`."""

    def __init__(self, path: Path, specs: list[Spec], metadata: dict[str, str]):
        assert sys.byteorder == "little", "safetensors stores little-endian values"
        self.path, self.specs, self.written = path, specs, 0
        header: dict = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in specs:
            n = nbytes((name, dtype, shape))
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the library pads it
        self.tmp = path.with_name(path.name + ".tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 (closed by close())
        self.file.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, dtype, shape = self.specs[self.written]
        assert (name, tensor.dtype, tuple(tensor.shape)) == (want_name, dtype, shape), (name, want_name)
        if tensor.numel():
            self.file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self.written += 1

    def close(self) -> None:
        assert self.written == len(self.specs), (self.path, self.written, len(self.specs))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
