"""Data pipeline: tokenizers, document sources, packing with document boundaries, and the
deterministic, layout-independent sequence order.

``build_data(source, tokenizer, seq_len, seed)`` wires the pieces: a tokenizer
(``tokenizer``), the packed token stream of a source (``sources``, ``packing``) and the order
in which training reads it (``loader``). Each module's docstring states its invariants.
"""

from mop.data.chat_packing import ChatDataset
from mop.data.errors import DataError
from mop.data.loader import (
    Data,
    SequenceStream,
    build_data,
    collate,
    count_targets,
    group_slice,
    load_batch,
    load_dataset,
    micro_batches,
    sequence_shard,
    source_options,
    to_device,
)
from mop.data.packing import IGNORE_INDEX, ConcatTokens, PackedDataset, fingerprint, pack_documents
from mop.data.sources import iter_documents, load_token_stream, read_bin, read_texts, source_files
from mop.data.tokenizer import AnyTokenizer, ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "AnyTokenizer",
    "ByteTokenizer",
    "ChatDataset",
    "ConcatTokens",
    "Data",
    "DataError",
    "HFTokenizer",
    "PackedDataset",
    "SequenceStream",
    "build_data",
    "collate",
    "count_targets",
    "fingerprint",
    "group_slice",
    "iter_documents",
    "load_batch",
    "load_dataset",
    "load_token_stream",
    "load_tokenizer",
    "micro_batches",
    "pack_documents",
    "read_bin",
    "read_texts",
    "sequence_shard",
    "source_options",
    "to_device",
    "source_files",
]
