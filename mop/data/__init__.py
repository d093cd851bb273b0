"""Data pipeline: tokenizers, document sources, packing with document boundaries, the
deterministic, layout-independent sequence order, and one package per data format beside them
(`README.md` here: the layout and how to add a format).

Shared, below the formats: ``errors``, ``bisection``, ``rows`` (data files' rows, named alike),
``tokenizer``, ``sources`` (text sources), ``packing`` (text cut into windows; whole items packed
by best-fit decreasing, what every format's dataset is made of), message rendering (``conversations``:
sources of message rows; ``templates`` with ``turns``: a conversation rendered with the model's
chat template and its assistant targets; the three formats all render messages) and ``prepared``
(rows encoded once, in memory or into a prepared folder; a format that prepares its rows gives it a
``Kind``).

One package per format, above them: ``chat`` (conversations encoded and packed whole),
``preference`` (TRL's pair rows read and checked, encoded, packed with each prompt once) and
``rollouts`` (recorded rollouts read and checked, advantages from rewards, packed whole). A format
package imports the shared modules, never another format's.

Above the formats, the dispatchers: ``kinds`` (the prepared kinds, chat and preference: a chat or
preference source's corpus, encoded or memory-mapped, and ``mop data prepare``), ``loader``
(``build_data``: the dataset of any data.format and the order in which training reads it) and
``inspection`` (``mop data inspect``: what training sees of chat and preference rows). Each
module's docstring states its invariants.

The names below are imported on first use (PEP 562): a worker process of ``mop data prepare``
imports ``mop.data.prepared`` and its kind's ``corpus`` module alone, without torch (about 200 MB
and seconds per worker).
"""

from importlib import import_module

_OWNERS = {
    "ChatDataset": "chat.packing",
    "describe_packed": "packing",
    "DataError": "errors",
    "PreferenceDataset": "preference.packing",
    "RolloutDataset": "rollouts.packing",
    "RolloutSettings": "rollouts.corpus",
    "RouteShape": "rollouts.rows",
    **dict.fromkeys(["Data", "SequenceStream", "build_data", "collate", "count_targets", "group_slice", "load_batch",
                     "load_dataset", "micro_batches", "sequence_shard", "source_options", "to_device"], "loader"),
    **dict.fromkeys(["IGNORE_INDEX", "ConcatTokens", "PackedDataset", "fingerprint", "pack_documents"], "packing"),
    **dict.fromkeys(["iter_documents", "load_token_stream", "read_bin", "read_texts", "source_files"], "sources"),
    **dict.fromkeys(["AnyTokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer"], "tokenizer"),
}
__all__ = sorted(_OWNERS)


def __getattr__(name: str):
    if name not in _OWNERS:
        raise AttributeError(f"module 'mop.data' has no attribute {name!r}")
    return getattr(import_module(f"mop.data.{_OWNERS[name]}"), name)


def __dir__():
    return __all__
