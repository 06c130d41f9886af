"""Safetensors tensors read on demand, by slice: how `specjax.load(..., mesh=)` reads each device's part of a weight.

Conversion (hf.py, qwen35.py, moe.py) runs unchanged over `LazyTensors` instead of a dict of arrays: what it does
to a tensor (transpose, cast, basic slicing, stacking layers or experts) builds a view that reads nothing, and
indexing a view reads only the elements it covers (`safe_open(...).get_slice(name)[...]`). So placing a weight
split over 8 devices reads 1/8 of it per device, and the checkpoint never sits whole in host memory. The few
transforms that mix elements across a tensor (Qwen3.5's per-head [query | gate] split of q_proj, Qwen3-Next's
fused projections) are `deferred`: they read their source tensors whole when placed, one weight at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

# safetensors' dtype names -> numpy
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
# dtypes safetensors' numpy reader does not know (it looks them up on numpy): read from the file's bytes.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
ST_DTYPES.update(RAW_DTYPES)


def read_raw(file: Path, name: str) -> np.ndarray:
    """One tensor of a safetensors file as a read-only memory map of its bytes (FP8 weights: `RAW_DTYPES`)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    info = header[name]
    start, stop = info["data_offsets"]
    dtype = np.dtype(RAW_DTYPES[info["dtype"]])
    count = int(np.prod(info["shape"], dtype=np.int64))
    if stop - start != count * dtype.itemsize or 8 + size + stop > Path(file).stat().st_size:
        raise ValueError(f"{file}: tensor '{name}' is truncated ({stop - start} bytes for shape {info['shape']}); "
                         "re-download or re-save it")
    return np.memmap(file, dtype=dtype, mode="r", offset=8 + size + start, shape=tuple(info["shape"]))


class LazyArray:
    """An array-like whose elements are read when indexed. Subclasses implement `read(index)` for an index of one
    slice (step 1) per dimension; everything else (views, casts, `np.asarray`) is built on it."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def read(self, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def T(self) -> "LazyArray":
        return self.transpose()

    def transpose(self, *axes) -> "LazyArray":
        axes = tuple(axes[0]) if len(axes) == 1 and not isinstance(axes[0], int) else axes
        return Transposed(self, axes or tuple(reversed(range(self.ndim))))

    def astype(self, dtype) -> "LazyArray":
        return self if np.dtype(dtype) == self.dtype else Cast(self, np.dtype(dtype))

    def reshape(self, *shape) -> np.ndarray:
        """Reshaping mixes elements across dimensions: the whole tensor is read (use `deferred` to postpone it)."""
        return np.asarray(self).reshape(*shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self.read(tuple(slice(0, n) for n in self.shape))
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, index):
        starts, stops, squeeze = basic_index(index, self.shape)
        if squeeze == () and starts == (0,) * self.ndim and stops == self.shape:
            return self
        return Sliced(self, starts, stops, squeeze)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"


def basic_index(index, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(starts, stops, squeezed dims) of a basic index (ints, step-1 slices, one Ellipsis) into `shape`."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of shape {shape}")
    starts, stops, squeeze = [], [], []
    for dim, (i, n) in enumerate(zip(index, shape)):
        if isinstance(i, (int, np.integer)):
            i = int(i) + n if i < 0 else int(i)
            if not 0 <= i < n:
                raise IndexError(f"index {i} is out of bounds for dimension {dim} of size {n}")
            starts.append(i), stops.append(i + 1), squeeze.append(dim)
        elif isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise IndexError(f"a lazily read tensor takes step-1 slices only, got {i}")
            starts.append(start), stops.append(max(start, stop))
        else:
            raise IndexError(f"a lazily read tensor takes ints and slices only, got {i!r}")
    return tuple(starts), tuple(stops), tuple(squeeze)


class Stored(LazyArray):
    """One tensor of a safetensors file."""

    def __init__(self, files: "LazyTensors", file: Path, name: str, shape: tuple[int, ...], dtype):
        self.files, self.file, self.name, self.shape, self.dtype = files, file, name, shape, np.dtype(dtype)

    def read(self, index):
        handle = self.files.handle(self.file)
        try:
            if self.dtype in RAW_DTYPES.values():
                return np.asarray(read_raw(self.file, self.name)[index])
            if not self.shape:
                return np.asarray(handle.get_tensor(self.name))
            return np.asarray(handle.get_slice(self.name)[index])
        except (SafetensorError, OSError) as err:
            raise unreadable(self.file, err) from None


class Sliced(LazyArray):
    """A basic-slice view: dims `squeeze` of the base taken at one index and dropped."""

    def __init__(self, base: LazyArray, starts, stops, squeeze):
        self.base, self.starts, self.stops, self.squeeze = base, starts, stops, squeeze
        self.shape = tuple(b - a for d, (a, b) in enumerate(zip(starts, stops)) if d not in squeeze)
        self.dtype = base.dtype

    def read(self, index):
        inner = iter(index)
        base_index = []
        for d, (a, b) in enumerate(zip(self.starts, self.stops)):
            if d in self.squeeze:
                base_index.append(slice(a, a + 1))
            else:
                start, stop, _ = next(inner).indices(b - a)
                base_index.append(slice(a + start, a + max(start, stop)))
        out = self.base.read(tuple(base_index))
        return out.reshape(tuple(n for d, n in enumerate(out.shape) if d not in self.squeeze))


class Transposed(LazyArray):
    def __init__(self, base: LazyArray, axes: tuple[int, ...]):
        self.base, self.axes = base, tuple(a % base.ndim for a in axes)
        self.shape, self.dtype = tuple(base.shape[a] for a in self.axes), base.dtype

    def read(self, index):
        base_index = [slice(None)] * self.ndim
        for i, a in enumerate(self.axes):
            base_index[a] = index[i]
        return self.base.read(tuple(base_index)).transpose(self.axes)


class Cast(LazyArray):
    def __init__(self, base: LazyArray, dtype: np.dtype):
        self.base, self.shape, self.dtype = base, base.shape, dtype

    def read(self, index):
        return self.base.read(index).astype(self.dtype)


class Stacked(LazyArray):
    """Arrays of one shape stacked on a new leading axis (layers, experts); indexing one part returns it."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.shape, self.dtype = (len(self.parts), *self.parts[0].shape), np.dtype(self.parts[0].dtype)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            return self.parts[int(index)]
        return super().__getitem__(index)

    def read(self, index):
        first, rest = index[0], index[1:]
        start, stop, _ = first.indices(len(self.parts))
        return np.stack([np.asarray(p[rest]) for p in self.parts[start:stop]])


class Deferred(LazyArray):
    """`fn()` (a transform of whole tensors) computed when the array is read, then indexed."""

    def __init__(self, fn: Callable[[], np.ndarray], shape: tuple[int, ...], dtype):
        self.fn, self.shape, self.dtype = fn, tuple(shape), np.dtype(dtype)

    def read(self, index):
        return np.asarray(self.fn())[index]


def is_lazy(x) -> bool:
    return isinstance(x, LazyArray)


def stack(xs) -> np.ndarray | LazyArray:
    """np.stack, or a lazy stack when any part is read lazily."""
    xs = list(xs)
    return Stacked(xs) if any(is_lazy(x) for x in xs) else np.stack(xs)


def deferred_parts(fn: Callable[[], tuple], shapes: list[tuple[int, ...]], dtype, *sources) -> tuple:
    """The parts fn() returns (a transform of whole tensors into several weights): computed now when none of
    `sources` is lazy (plain conversion), else each postponed until it is read (then fn() runs for that part)."""
    if not any(is_lazy(s) for s in sources):
        return tuple(fn())
    return tuple(Deferred(lambda i=i: fn()[i], shape, dtype) for i, shape in enumerate(shapes))


def unreadable(file: Path, err: Exception) -> ValueError:
    reason = " ".join(str(err).split()) or type(err).__name__
    return ValueError(f"{file}: not a readable safetensors file ({reason}); it may be truncated or corrupt "
                      "(an interrupted download or save): re-download or re-save it")


class LazyTensors(Mapping):
    """name -> Stored for every tensor of `files`, reading only the headers (each file opened once, memory-mapped)."""

    def __init__(self, files: list[Path]):
        self._handles: dict[Path, object] = {}
        self._tensors: dict[str, Stored] = {}
        for file in files:
            handle = self.handle(file)
            try:
                for name in handle.keys():
                    info = handle.get_slice(name)
                    dtype = info.get_dtype()
                    if dtype not in ST_DTYPES:
                        raise ValueError(f"{file}: tensor '{name}' has dtype {dtype}, which specjax does not read")
                    self._tensors[name] = Stored(self, file, name, tuple(info.get_shape()), ST_DTYPES[dtype])
            except (SafetensorError, OSError) as err:
                raise unreadable(file, err) from None

    def handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="np")
            except (SafetensorError, OSError) as err:
                raise unreadable(file, err) from None
        return self._handles[file]

    def __getitem__(self, name: str) -> Stored:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
