"""Safetensors files of a model directory: listing, cheap header reads, and tensor loading.

Handles one `model.safetensors`, sharded `model-0000x-of-0000y.safetensors` (with or without the
index json) and any other `*.safetensors` set. Headers are read without touching tensor data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of `model_dir`, sorted; ValueError if there is none."""
    index = model_dir / _INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"model {model_dir}: weight shards listed in {_INDEX} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model {model_dir}: no weights (*.safetensors) found")
    return files


def read_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} from a safetensors header (no data read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def tensor_signature(files: Iterable[Path]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Sorted (name, dtype, shape) of every tensor in `files`."""
    rows = []
    for path in files:
        for name, info in read_header(path).items():
            rows.append((name, info["dtype"], tuple(info["shape"])))
    return sorted(rows)


# (tensor name, safetensors slice handle: `handle[a:b]`, `handle[:, a:b]`, `handle.get_shape()`) -> the
# part of the tensor to load (a tensor-parallel rank reads only its rows or columns), None: none of it
Slicer = Callable[[str, Any], "torch.Tensor | None"]


# (tensor name, the tensor as read) -> what to keep of it (server/models/fp8/load.py: the model dtype,
# float8 tensors and scales as they are, or quantized)
Convert = Callable[[str, torch.Tensor], Any]


def load_tensors(files: Iterable[Path], *, device: torch.device, convert: Convert, skip: Callable[[str], bool],
                 slicer: Slicer | None = None) -> dict[str, Any]:
    """All tensors of `files` (or, with `slicer`, the part of each it picks), each converted by
    `convert` as it is read, on `device`. A slice is read from the file alone: the rest of the tensor
    is never loaded; a tensor whose name `skip` accepts, none of it."""
    out: dict[str, Any] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:  # straight onto the device
            for name in f.keys():
                if skip(name):
                    continue
                tensor = f.get_tensor(name) if slicer is None else slicer(name, f.get_slice(name))
                if tensor is None:
                    continue
                out[name] = convert(name, tensor)
    return out
