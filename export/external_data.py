"""Graphs whose weights live beside them, written one tensor at a time.

A protobuf message cannot be serialized past 2 GiB, and the onnx package serializes an initializer
whenever it is copied into a graph (``graph.initializer.extend``): a single weight of 2 GiB or more
(a 128k-vocabulary embedding at hidden 4096 in fp32 is 2.1 GB, at 8192 4.2 GB) fails there, before
``onnx.save(save_as_external_data=True)`` could move it out. ``DataFile`` writes each large tensor's
bytes straight into ``<graph>.data`` and gives the graph a TensorProto that only points at them, so
no message ever holds the weights (and the process holds each weight once, not twice).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

INLINE_BELOW = 1024  # bytes: smaller tensors stay inside the graph (scalars, split sizes, axes)
ALIGN = 4096  # large tensors start on a page boundary (Linux), so a runtime may memory-map them


class DataFile:
    """Appends tensors to the data file ``path``, which must sit in the graph's folder.

    ``tensor(name, array)`` returns a TensorProto for the graph: inline below ``INLINE_BELOW``
    bytes, otherwise external, its bytes already written. ``adopt(tensor, base_dir)`` does the
    same for a tensor of an existing graph (inline or external under ``base_dir``), copying its
    bytes in chunks. Use as a context manager; the file is flushed and closed on exit.
    """

    def __init__(self, path: Path):
        self.path, self.location = path, path.name
        self._fh = open(path, "xb")  # never an existing file: it may be the one being adopted from

    def __enter__(self) -> "DataFile":
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()

    def tensor(self, name: str, array: np.ndarray):
        from onnx import TensorProto, helper, numpy_helper

        array = np.require(array, requirements="C")  # keeps a scalar's shape [] (ascontiguousarray gives [1])
        if array.nbytes < INLINE_BELOW or array.dtype.kind in "OUS":  # strings are not raw bytes
            return numpy_helper.from_array(array, name)
        data_type = helper.np_dtype_to_tensor_dtype(array.dtype.newbyteorder("="))
        if array.dtype.byteorder == ">" or (array.dtype.byteorder == "=" and sys.byteorder != "little"):
            array = array.astype(array.dtype.newbyteorder("<"))  # ONNX stores raw data little-endian
        proto = TensorProto(name=name, data_type=data_type, dims=array.shape)
        offset = self._append(memoryview(array.reshape(-1)).cast("B"))
        return self._point(proto, offset, array.nbytes)

    def adopt(self, tensor, base_dir: Path):
        """``tensor`` (a TensorProto of a graph in ``base_dir``) as a TensorProto of this file."""
        from onnx import TensorProto, external_data_helper

        if tensor.data_location != TensorProto.EXTERNAL:
            if tensor.ByteSize() < INLINE_BELOW or not tensor.HasField("raw_data"):
                return tensor
            proto = TensorProto()
            proto.CopyFrom(tensor)
            proto.ClearField("raw_data")
            return self._point(proto, self._append(tensor.raw_data), len(tensor.raw_data))
        info = external_data_helper.ExternalDataInfo(tensor)
        source = base_dir / info.location  # a graph the exporter wrote itself, in its folder
        proto = TensorProto()
        proto.CopyFrom(tensor)
        proto.ClearField("raw_data")  # older onnx's to_array(base_dir=...) cached the bytes here
        with open(source, "rb") as src:
            src.seek(info.offset or 0)
            start = self._aligned()
            length = info.length if info.length is not None else source.stat().st_size - (info.offset or 0)
            copied = _copy(src, self._fh, length)
        if copied != length:
            raise OSError(f"{source} ends before tensor {tensor.name!r} does ({copied} of {length} bytes)")
        return self._point(proto, start, length)

    def _aligned(self) -> int:
        offset = self._fh.tell()
        pad = -offset % ALIGN
        self._fh.write(b"\0" * pad)
        return offset + pad

    def _append(self, data) -> int:
        offset = self._aligned()
        self._fh.write(data)
        return offset

    def _point(self, proto, offset: int, length: int):
        from onnx import TensorProto

        del proto.external_data[:]
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(length))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        proto.data_location = TensorProto.EXTERNAL
        return proto


def _copy(src, dst, length: int, chunk: int = 64 << 20) -> int:
    """Copy ``length`` bytes from ``src``'s position to ``dst``; return how many there were."""
    done = 0
    while done < length:
        block = src.read(min(chunk, length - done))
        if not block:
            break
        dst.write(block)
        done += len(block)
    return done


def initializer_bytes(tensors) -> int:
    """Bytes of TensorProtos, inline or external (without reading external files)."""
    from onnx import TensorProto, external_data_helper

    total = 0
    for t in tensors:
        if t.data_location == TensorProto.EXTERNAL:
            total += external_data_helper.ExternalDataInfo(t).length or 0
        else:
            total += t.ByteSize()
    return total

