"""Every source type, read back as documents and as a packed stream, and its error messages."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mop.data import ByteTokenizer, DataError, build_data, iter_documents, load_token_stream

TOK = ByteTokenizer()
DOCS = ["First document.\nIt has two lines.", "Zweites Dokument: grüße!", "third"]


def texts(source, **kw):
    return [TOK.decode(d) for d in iter_documents(str(source), TOK, **kw)]


def write_bin(path, docs, dtype, trailing_eos=True):
    ids = []
    for d in docs:
        ids += [*TOK.encode(d), TOK.eos_id]
    if not trailing_eos:
        ids.pop()
    np.array(ids, dtype=dtype).tofile(path)
    return path


def test_txt_splits_on_blank_lines(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\n\n".join(DOCS) + "\r\n \r\n\n\n", encoding="utf-8")
    assert texts(path) == DOCS


def test_jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(DOCS)]
    path.write_text("\n".join([lines[0], "", lines[1], json.dumps({"body": ""}), lines[2]]))
    assert texts(path, text_field="body") == DOCS
    with pytest.raises(DataError, match=r"a\.jsonl row 1 has no field 'text'.*data\.text_field"):
        texts(path)


def test_jsonl_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl row 2 is not valid JSON"):
        texts(path)
    path.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl row 1 has a int"):
        texts(path)


def test_parquet(tmp_path):
    path = tmp_path / "a.parquet"
    table = pa.table({"text": DOCS + [None], "n": [1, 2, 3, 4]})
    pq.write_table(table, path, row_group_size=2)
    assert texts(path) == DOCS
    with pytest.raises(DataError, match=r"a\.parquet has no column 'body' \(columns: text, n\)"):
        texts(path, text_field="body")


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin(tmp_path, dtype):
    path = write_bin(tmp_path / "a.bin", DOCS, dtype)
    assert texts(path, bin_dtype=dtype) == DOCS
    tokens, starts = load_token_stream(str(path), TOK, bin_dtype=dtype)
    assert isinstance(tokens, np.memmap)
    assert starts.tolist() == [0, len(DOCS[0].encode()) + 1, len(DOCS[0].encode() + DOCS[1].encode()) + 2]


def test_bin_errors(tmp_path):
    path = tmp_path / "big.bin"
    np.array([1, 2, TOK.vocab_size, 3], dtype="uint16").tofile(path)
    with pytest.raises(DataError, match=r"big\.bin holds token id 259 at position 2"):
        texts(path)
    np.array([1, 2, 3], dtype="uint16").tofile(path)
    with pytest.raises(DataError, match=r"big\.bin has 6 bytes, not a multiple of 4"):
        texts(path, bin_dtype="uint32")
    with pytest.raises(DataError, match="data.bin_dtype = 'int8'"):
        texts(path, bin_dtype="int8")


def test_directory_reads_supported_files_in_order(tmp_path):
    write_bin(tmp_path / "b.bin", DOCS[1:], "uint16", trailing_eos=False)
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "last"}))
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / ".hidden.txt").write_text("skipped")
    assert texts(tmp_path) == DOCS + ["last"]
    tokens, starts = load_token_stream(str(tmp_path), TOK)
    stream = tokens[0 : len(tokens)]
    # b.bin lacks a trailing eos, yet its last document still ends at the file boundary.
    ends = [int(s) for s in starts[1:]]
    assert [TOK.decode(stream[a:b]) for a, b in zip([0, *ends], [*ends, len(tokens)])] == DOCS + ["last"]
    assert stream[ends[0] - 1] == TOK.eos_id and stream[ends[2] - 1] != TOK.eos_id


def test_missing_and_unknown(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt does not exist.*'builtin'") as e:
        texts(tmp_path / "nope.txt")
    assert "\n" not in str(e.value)
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(DataError, match=r"a\.csv has unsupported extension '\.csv'"):
        texts(tmp_path / "a.csv")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no"):
        texts(empty)
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="holds no documents"):
        load_token_stream(str(tmp_path / "blank.txt"), TOK)


@pytest.mark.parametrize("name, where", [("latin1.txt", "line 3"), ("latin1.jsonl", "row 3")])
def test_non_utf8_text_is_named_by_its_row(tmp_path, name, where):
    path = tmp_path / name
    path.write_bytes(b'{"text": "ok"}\n\n' + '{"text": "caf\xe9"}\n{"text": "fine"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=rf"^data\.source: .*{name} {where} is not valid UTF-8 \(invalid continuation "
                                        r"byte at its byte 14\); re-encode the file as UTF-8$"):
        texts(path)


def test_bin_and_text_pack_identically(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    write_bin(tmp_path / "a.bin", DOCS, "uint32")
    from_text = build_data(str(tmp_path / "a.jsonl"), "byte", seq_len=5, seed=1)
    from_bin = build_data(str(tmp_path / "a.bin"), "byte", seq_len=5, seed=1, bin_dtype="uint32")
    assert isinstance(from_bin.dataset.tokens, np.memmap)
    assert from_text.stream.state_dict() == from_bin.stream.state_dict()
    for i in range(len(from_text.dataset)):
        a, b = from_text.dataset[i], from_bin.dataset[i]
        assert all(a[k].equal(b[k]) for k in a)
