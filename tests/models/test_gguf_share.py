"""gguf_read_once: transformers' reads of one GGUF file (config, tokenizer, tensors)
share one reader and one conversion of its metadata, with the same results as three
reads apart; blocks nest and open in several threads."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import gguf
import numpy as np
import pytest
import torch
from gguf.gguf_reader import GGUFReader  # the class, not the attribute tests count at
from gguf_files import write_tiny_gguf
from transformers import modeling_gguf_pytorch_utils as gguf_utils

from batchgen.models.gguf_share import gguf_read_once
from batchgen.models.loader import ModelSource


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


class Counted:
    """gguf's reader, gguf's name map and transformers' value conversion, counted at the
    module attributes transformers looks them up in (as gguf_read_once finds them)."""

    def __init__(self, monkeypatch):
        self.readers, self.maps, self.values = [], [], 0
        make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
        parse = gguf_utils._gguf_parse_value

        def reader(path, mode="r"):
            self.readers.append(str(path))
            return make_reader(path, mode)

        def name_map(arch, n_blocks):
            self.maps.append((arch, n_blocks))
            return make_map(arch, n_blocks)

        def value(element, types):
            self.values += 1
            return parse(element, types)

        self.own = (reader, name_map, value)
        monkeypatch.setattr(gguf, "GGUFReader", reader)
        monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
        monkeypatch.setattr(gguf_utils, "_gguf_parse_value", value)

    def restored(self) -> bool:
        now = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils._gguf_parse_value)
        return all(a is b for a, b in zip(now, self.own))


def elements(path) -> int:
    """How many values the file's metadata holds (an array field: one per element)."""
    return sum(len(field.data) for field in GGUFReader(path).fields.values())


def load(path):
    """What an engine build reads from a GGUF: config, tokenizer, tensors."""
    source = ModelSource.resolve(str(path))
    config = source.load_config()
    return config, source.load_tokenizer(), dict(source.weights(config))


def test_one_parse_gives_the_config_tokenizer_and_weights_of_three(tiny_gguf, monkeypatch):
    count = Counted(monkeypatch)
    apart = load(tiny_gguf)
    readers_apart, values_apart, maps_apart = len(count.readers), count.values, len(count.maps)
    with gguf_read_once():
        shared = load(tiny_gguf)
    assert count.restored()
    # apart: config, the tokenizer's config and the tensors each parse the file anew
    assert readers_apart == 3 and values_apart > 3 * elements(tiny_gguf)
    assert count.readers[readers_apart:] == [str(tiny_gguf)]
    assert count.values - values_apart == elements(tiny_gguf)  # each value converted once
    assert maps_apart > 1 and len(count.maps) == maps_apart + 1  # one, not one a module

    (config, tokenizer, weights), (config_1, tokenizer_1, weights_1) = apart, shared
    assert config_1.to_dict() == config.to_dict()
    assert tokenizer_1.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert tokenizer_1.special_tokens_map == tokenizer.special_tokens_map
    text = "the cat in the hat<|im_end|>"
    assert tokenizer_1(text).input_ids == tokenizer(text).input_ids
    assert weights_1.keys() == weights.keys() and len(weights) == 2 + 9 * 2
    for name, tensor in weights.items():
        assert torch.equal(weights_1[name], tensor), name


def test_nested_blocks_share_until_the_outermost_leaves(tiny_gguf, monkeypatch):
    count = Counted(monkeypatch)
    source = ModelSource.resolve(str(tiny_gguf))
    with gguf_read_once():
        config = source.load_config()
        with gguf_read_once():
            assert source.load_config().to_dict() == config.to_dict()
        assert not count.restored()  # the outer block still shares
        source.load_tokenizer()
        values = count.values
    assert count.restored()
    assert count.readers == [str(tiny_gguf)] and values == elements(tiny_gguf)
    with pytest.raises(RuntimeError), gguf_read_once():
        raise RuntimeError("a failed load")
    assert count.restored()
    source.load_config()
    assert count.readers == [str(tiny_gguf)] * 2  # outside, each read parses anew


def test_blocks_of_two_threads_share_and_leave_in_any_order(tiny_gguf, monkeypatch):
    """Thread A opens first and leaves first while B still reads (A reads after B, B
    after A left): B keeps sharing, and once both left gguf's and transformers'
    functions are the ones from before."""
    count = Counted(monkeypatch)
    source = ModelSource.resolve(str(tiny_gguf))
    b_read, a_left = threading.Event(), threading.Event()
    configs, errors = [], []

    def thread_b():
        try:
            with gguf_read_once():
                configs.append(source.load_config().to_dict())
                b_read.set()
                a_left.wait(timeout=60)
                configs.append(source.load_config().to_dict())
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread below
            errors.append(e)

    with ExitStack() as a_block:
        a_block.enter_context(gguf_read_once())
        worker = threading.Thread(target=thread_b)
        worker.start()
        assert b_read.wait(timeout=60)
        configs.append(source.load_config().to_dict())
    a_left.set()
    worker.join(timeout=120)
    assert not worker.is_alive() and not errors, errors
    assert count.restored()
    assert len(configs) == 3 and configs[0] == configs[1] == configs[2]
    assert count.readers == [str(tiny_gguf)]  # both threads' three reads, one parse
    assert count.values == elements(tiny_gguf)


def test_an_element_is_converted_anew_when_its_bytes_may_change_or_its_types_differ():
    """The conversion is kept only for read-only bytes (a reader's memory map opened "r")
    and for the types list it was made under."""
    uint32 = 4  # GGUF's value type of a uint32
    writable = np.array([5], dtype=np.uint32)
    frozen = np.array([7], dtype=np.uint32)
    frozen.flags.writeable = False
    types, other_types = [uint32], [6]  # 6: float32, read from the same element
    with gguf_read_once():
        parse = gguf_utils._gguf_parse_value
        assert parse(writable, types) == 5
        writable[0] = 6
        assert parse(writable, types) == 6
        assert parse(frozen, types) == 7 and parse(frozen, types) == 7
        assert isinstance(parse(frozen, other_types), float)
        assert parse(frozen, types) == 7 and isinstance(parse(frozen, types), int)


def test_the_shared_reader_keeps_its_file_as_a_plain_read_only_array(tiny_gguf):
    """The shared reader (gguf's class, its file a plain ndarray view of the memory map:
    gguf_share's docstring) gives the fields and tensors gguf's own reader gives."""
    own = GGUFReader(tiny_gguf)
    with gguf_read_once():
        shared = gguf.GGUFReader(tiny_gguf)
        assert shared is gguf.GGUFReader(tiny_gguf)  # one reader a file
    assert isinstance(shared, GGUFReader)
    assert type(own.data) is np.memmap and type(shared.data) is np.ndarray
    assert not shared.data.flags.writeable  # the same read-only mapping
    assert list(shared.fields) == list(own.fields)
    for name, field in own.fields.items():
        other = shared.fields[name]
        assert other.types == field.types and other.data == field.data, name
        for part, part_1 in zip(field.parts, other.parts):
            assert type(part_1) is np.ndarray and np.array_equal(part_1, part), name
    assert [t.name for t in shared.tensors] == [t.name for t in own.tensors]
    for tensor, tensor_1 in zip(own.tensors, shared.tensors):
        assert type(tensor_1.data) is np.ndarray
        assert np.array_equal(tensor_1.data, tensor.data), tensor.name
