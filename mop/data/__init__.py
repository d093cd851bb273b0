"""Data pipeline: tokenizers, document sources, packing with document boundaries, the
deterministic, layout-independent sequence order, chat data (conversations, templates,
prepared folders, packing of whole conversations) and preference pairs (read, prepared and packed
with each prompt once).

``build_data(source, tokenizer, seq_len, seed)`` wires the pieces: a tokenizer
(``tokenizer``), the packed token stream of a source (``sources``, ``packing``; for chat,
``conversations``, ``templates`` with ``turns``, ``prepared``, ``chat_packing``; for preference
pairs, ``preferences`` and ``preference_packing``; for recorded rollouts, ``rollouts`` and
``rollout_packing``) and the order in which training reads it
(``loader``); ``inspection`` shows what training sees of chat and preference data. Each module's
docstring states its invariants.

The names below are imported on first use (PEP 562): a worker process of ``mop data prepare``
imports ``mop.data.prepared`` alone, without torch (about 200 MB and seconds per worker).
"""

from importlib import import_module

_OWNERS = {
    "ChatDataset": "chat_packing",
    "describe_packed": "chat_packing",
    "DataError": "errors",
    "PreferenceDataset": "preference_packing",
    "RolloutDataset": "rollout_packing",
    **dict.fromkeys(["RolloutSettings", "RouteShape"], "rollouts"),
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
