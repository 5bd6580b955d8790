"""One parse of a GGUF file for all of transformers' reads of it while a model loads.

transformers reads a GGUF file anew for the config, for the tokenizer's config and for
the tensors (`load_gguf_checkpoint`, three calls for the default model). Each call builds
gguf's reader over every field (a 49k-token vocabulary and its merges: seconds), converts
every element of every field to a Python value (`_gguf_parse_value`, about half a second
a call), and builds gguf's tensor name map anew for every module it maps names for.
Inside `gguf_read_once` the three are shared: gguf's `GGUFReader` hands out one reader per
file (read-only, memory-mapped), `get_tensor_name_map` one map per (architecture,
layers), and transformers' `_gguf_parse_value` converts each read-only element once,
later reads of the same element getting the value it gave (ints, floats, strings: never
mutated). All three are looked up in their modules at the time of the call, so this
module swaps those module attributes; the call sites stay transformers' own.

The shared reader also holds its file as a plain ndarray view of the memory map rather
than numpy's memmap subclass: the reader slices the file once for every part of every
field (about 150k slices for the default model's vocabulary and merges), and a memmap
slice pays the subclass's Python-level finalisation each time (default model: the
reader's build 3.3 -> 1.5 s on a loaded CPU). The bytes are the same mapped pages,
read-only as before.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Inside, every read of one GGUF file shares one parse of it and one conversion of
    its metadata; on leaving the outermost block, gguf's and transformers' functions are
    back and what was shared is dropped. Blocks may nest and may be entered from several
    threads: the sharing lasts while any block is open (a read in another thread then
    shares too, with the same results). Without gguf installed, nothing changes."""
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    _OPEN.enter(gguf, gguf_utils)
    try:
        yield
    finally:
        _OPEN.leave()


class _Sharing:
    """What the reads of one sharing period share, and the module functions it replaces."""

    def __init__(self, gguf, gguf_utils) -> None:
        self.gguf, self.gguf_utils = gguf, gguf_utils
        self.make_reader = gguf.GGUFReader
        # gguf's class, made to keep its file as a plain array (a replacement that is not
        # a class, a test's counter say, is called as it is)
        self.plain_reader = (
            _plain_reader(self.make_reader) if isinstance(self.make_reader, type) else None
        )
        self.make_map = gguf.get_tensor_name_map
        # a transformers without it (a private name) still shares the reader and the map
        self.parse = getattr(gguf_utils, "_gguf_parse_value", None)
        self.readers: dict[tuple[str, str], object] = {}
        self.reader_lock = threading.Lock()  # a second thread waits for the first's parse
        # by id(element), written once: the element (kept, so that the id stays its own),
        # the types it was converted under and its value (dicts of plain values: a tuple an
        # element made the collector walk the process's heap, +0.3 s)
        self.elements: dict[int, object] = {}
        self.types: dict[int, object] = {}
        self.values: dict[int, object] = {}
        self.value_lock = threading.Lock()

    def install(self) -> None:
        self.gguf.GGUFReader = self.reader
        self.gguf.get_tensor_name_map = functools.cache(self.make_map)
        if self.parse is not None:
            self.gguf_utils._gguf_parse_value = self.value

    def restore(self) -> None:
        self.gguf.GGUFReader = self.make_reader
        self.gguf.get_tensor_name_map = self.make_map
        if self.parse is not None:
            self.gguf_utils._gguf_parse_value = self.parse

    def reader(self, path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        with self.reader_lock:
            if key not in self.readers:
                make = self.plain_reader or self.make_reader
                self.readers[key] = make(path, mode)
            return self.readers[key]

    def value(self, element, types):
        """transformers' `_gguf_parse_value(element, types)`, once per element: an element
        is a read-only view into a shared reader's file, and `types` its field's list."""
        key = id(element)
        if self.elements.get(key) is element and self.types[key] is types:
            return self.values[key]
        parsed = self.parse(element, types)
        flags = getattr(element, "flags", None)
        if flags is not None and not flags.writeable:  # bytes that cannot change under it
            with self.value_lock:
                if key not in self.elements:  # the element last: a reader sees all three
                    self.types[key], self.values[key] = types, parsed
                    self.elements[key] = element
        return parsed


@functools.cache
def _plain_reader(reader_class: type) -> type:
    """reader_class (gguf's GGUFReader), its `data` (the memory map it sets first and
    slices every part from) kept as a plain ndarray view of the same pages."""

    def get_data(self):
        return self._plain_data

    def set_data(self, value):
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return type(reader_class.__name__, (reader_class,), {"data": property(get_data, set_data)})


class _OpenBlocks:
    """How many gguf_read_once blocks are open, over all threads, and their sharing."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.sharing: _Sharing | None = None

    def enter(self, gguf, gguf_utils) -> None:
        with self.lock:
            if self.depth == 0:
                self.sharing = _Sharing(gguf, gguf_utils)
                self.sharing.install()
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.sharing is not None:
                self.sharing.restore()
                self.sharing = None


_OPEN = _OpenBlocks()
