"""Checkpoint tensors read straight from a folder's safetensors files, without transformers.

`SafetensorsWeights` is a read-only mapping from checkpoint names (HF names, as the model
modules' `load_hf_state_dict` expect) to tensors. Each tensor is mapped from its file on first
access, copy-on-write and zero-copy: a loader that copies a shard out of a tensor makes only the
pages of that shard resident, and a tensor the model adopts as it is (the token embedding, whose
lookup touches a few rows a step) stays backed by the file instead of the heap.

Names are those of the checkpoint, except Mixtral's `block_sparse_moe.` blocks, which read as
`mlp.` (the name our MoE loader and transformers' own model use).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from collections.abc import Iterator, Mapping

import torch

from pdcore.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def checkpoint_files(folder: str) -> list[str]:
    """The safetensors files holding the model: those of model.safetensors.index.json when
    present (a folder may also ship e.g. consolidated.safetensors), else every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    return [os.path.join(folder, n) for n in names]


def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class SafetensorsWeights(Mapping[str, torch.Tensor]):
    def __init__(self, folder: str) -> None:
        self._entries: dict[str, tuple[str, int, dict]] = {}
        for path in checkpoint_files(folder):
            try:
                header, start = _header(path)
            except (OSError, ValueError, struct.error) as e:
                raise ModelLoadError(f"cannot read the safetensors header of {path}: {e}") from e
            header.pop("__metadata__", None)
            for name, meta in header.items():
                for old, new in _RENAMES:
                    name = name.replace(old, new)
                self._entries[name] = (path, start, meta)
        self._maps: list[weakref.ref] = []  # the mappings handed out (alive while used)

    def __getitem__(self, name: str) -> torch.Tensor:
        path, start, meta = self._entries[name]
        dtype = _DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{name} in {path} has dtype {meta['dtype']}, not supported")
        begin, end = (start + o for o in meta["data_offsets"])
        shape = tuple(meta["shape"])
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        page = mmap.ALLOCATIONGRANULARITY
        base = begin - begin % page
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), end - base, offset=base, access=mmap.ACCESS_COPY)
        self._maps.append(weakref.ref(mm))
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(mm, dtype=dtype, offset=begin - base, count=count).view(shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def release_pages(self) -> int:
        """Drop from this process the file pages that loading read through tensors still in use
        (the adopted embedding, whose every row a tied lm head copied): they stay in the page
        cache and fault back in row by row when used. Returns how many mappings are alive."""
        alive = [mm for mm in (r() for r in self._maps) if mm is not None]
        self._maps = [weakref.ref(mm) for mm in alive]
        for mm in alive:
            mm.madvise(mmap.MADV_DONTNEED)
        return len(alive)


def adopt(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.nn.Parameter:
    """`tensor` itself as the parameter when it matches in shape and dtype (no copy: a mapped
    checkpoint tensor stays file-backed), else `param` with `tensor` copied in. For weights read
    sparsely, such as the token embedding; GEMM weights are reordered anyway."""
    if tensor.shape != param.shape or tensor.dtype != param.dtype:
        return torch.nn.Parameter(param.copy_(tensor), requires_grad=False)
    return torch.nn.Parameter(tensor, requires_grad=False)
