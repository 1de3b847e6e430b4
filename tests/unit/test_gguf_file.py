"""engine/model/gguf_file.py against the gguf package's own GGUFReader: the same metadata values and
types and the same tensor views, on a file written here with every metadata type and on the
embedded SmolLM2 GGUF; a cut or corrupted file is a ModelLoadError naming the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from iterserve.engine.model.gguf_file import GGUFFile
from iterserve.engine.model.loader import ModelLoadError, _dequantize, open_gguf
from iterserve.engine.model.registry import resolve_model_path


def assert_same_as_gguf_reader(path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [key for key in theirs.fields if not key.startswith("GGUF.")]
    for key, field in ours.fields.items():
        mine, reference = field.contents(), theirs.fields[key].contents()
        assert mine == reference and type(mine) is type(reference), key
        if isinstance(mine, list) and mine:
            assert type(mine[0]) is type(reference[0]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == int(reference.tensor_type), mine.name
        assert mine.shape == tuple(int(d) for d in reference.shape), mine.name
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
        assert np.array_equal(mine.data, reference.data), mine.name
    return ours


@pytest.fixture
def every_type(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "every-type.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓ <|im_end|>")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü b"])
    writer.add_array("t.empty", [])
    weights = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32", weights)
    writer.add_tensor("f16", weights.astype(np.float16))
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        kind = gguf.GGMLQuantizationType[name]
        writer.add_tensor(name.lower(), gguf.quants.quantize(weights, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_metadata_type_and_tensor_reads_as_gguf_reader_reads_it(every_type):
    ours = assert_same_as_gguf_reader(every_type)
    assert ours.fields["t.u64"].contents() == 2**63 + 5 and ours.fields["t.strs"].contents() == ["a", "", "ü b"]
    reference = gguf.GGUFReader(every_type)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        # The loader's whole-tensor block path gives every weight gguf.quants.dequantize gives.
        expected = np.asarray(gguf.quants.dequantize(theirs.data, theirs.tensor_type), dtype=np.float32)
        assert np.array_equal(_dequantize(mine, every_type), expected.reshape(8, 64)), mine.name


@pytest.mark.slow
def test_the_embedded_model_reads_as_gguf_reader_reads_it():
    ours = assert_same_as_gguf_reader(resolve_model_path(None)[0])
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) == 49152


@pytest.mark.parametrize("keep", [3, 20, 200, 2000])
def test_a_cut_file_is_a_load_error_naming_it(every_type, tmp_path, keep):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(every_type.read_bytes()[:keep])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        open_gguf(cut)


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_gguf(path)


def test_a_string_length_past_the_end_is_a_load_error(every_type, tmp_path):
    data = bytearray(every_type.read_bytes())
    data[24:32] = (2**40).to_bytes(8, "little")  # the first key's length
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        open_gguf(bad)
