"""Deterministic, layout-independent order of packed sequences, and batching for training.

Order. Position ``p`` of the infinite stream (``p = e*N + o`` over ``N`` sequences) is sequence
``randperm(N, generator=manual_seed(epoch_seed(seed, e)))[o]``: epoch ``e`` is a fresh permutation and epochs
follow one another forever. The order is a pure function of ``(seed, N, p)``; no rank count,
group size or micro-batch size enters it, which is what makes every layout see the same data.

Batches. Optimizer step ``s`` with global batch ``G`` covers positions ``[s*G, (s+1)*G)``.
Data-parallel group ``g`` of ``n`` takes the contiguous slice ``[g*G/n, (g+1)*G/n)`` of that
step, then splits it into micro-batches of ``m`` sequences in order; concatenating the groups'
parts in group order gives back the step. Ranks that share sequences (a sequence-parallel
group, each holding a chunk of the same sequences) count as one group here.

Resume. The stream's only state is its position (sequences consumed). ``state_dict`` also
records the seed, ``seq_len``, sequence count and a corpus fingerprint, and ``load_state_dict``
refuses a state written for other data instead of silently continuing on a different order.
"""

import hashlib
from typing import NamedTuple

import torch

from mop.data.chat.packing import ChatDataset
from mop.data.errors import DataError
from mop.data.kinds import load_corpus, prepared_kind
from mop.data.packing import IGNORE_INDEX, PackedDataset
from mop.data.preference.packing import PreferenceDataset
from mop.data.prepared import ChatSettings, is_prepared, other_format
from mop.data.rollouts.corpus import RolloutSettings, read_rollouts
from mop.data.rollouts.packing import RolloutDataset
from mop.data.rollouts.rows import RolloutRows
from mop.data.sources import load_token_stream
from mop.data.tokenizer import AnyTokenizer, load_tokenizer


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed per (seed, epoch) pair; hashing keeps seed s, epoch 1 apart from seed s+1, epoch 0."""
    digest = hashlib.blake2b(f"data/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# Each part of a stream's state and the setting that decides it (the corpus: its source and tokenizer).
_STATE_SETTINGS = {"seed": "train.seed", "seq_len": "data.seq_len", "num_sequences": "data.source",
                   "fingerprint": "data.source"}


class SequenceStream:
    """Maps positions of the infinite permuted stream to sequence indices; see module docstring."""

    def __init__(self, num_sequences: int, seed: int, seq_len: int, fingerprint: str):
        if num_sequences < 1:
            raise DataError("the dataset holds no sequences; lower data.seq_len or add data")
        self.num_sequences = num_sequences
        self.seed = seed
        self.seq_len = seq_len
        self.fingerprint = fingerprint
        self.position = 0
        self._perms: dict[int, torch.Tensor] = {}

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            # A batch straddles at most two epochs, so two cached permutations are enough.
            while len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perms[epoch] = torch.randperm(self.num_sequences, generator=g)
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """Sequence indices at positions ``[start, start + count)`` of the stream."""
        if start < 0 or count < 0:
            raise ValueError(f"positions must be non-negative, got start={start} count={count}")
        out, p, end = [], start, start + count
        while p < end:
            epoch, offset = divmod(p, self.num_sequences)
            take = min(end - p, self.num_sequences - offset)
            out += self._permutation(epoch)[offset : offset + take].tolist()
            p += take
        return out

    def batch(self, step: int, global_batch: int) -> list[int]:
        """The global batch of optimizer step ``step``: positions ``[step*G, (step+1)*G)``."""
        return self.indices(step * global_batch, global_batch)

    def next_batch(self, global_batch: int) -> list[int]:
        """The next ``global_batch`` sequences from the current position, advancing it."""
        out = self.indices(self.position, global_batch)
        self.position += global_batch
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "num_sequences": self.num_sequences, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        for key, setting in _STATE_SETTINGS.items():
            if state[key] != getattr(self, key):
                raise DataError(
                    f"{setting}: cannot resume: the checkpoint's data stream has {key} = {state[key]!r} but "
                    f"this run has {getattr(self, key)!r}; resume with the same train.seed, data.source, "
                    "data.tokenizer and data.seq_len (for chat and preference data also data.chat_template, "
                    "data.loss_on and data.overlong; for preference data data.shared_prompt), or start a new run"
                )
        self.position = int(state["position"])


def group_slice(indices: list[int], group: int, num_groups: int) -> list[int]:
    """Data-parallel group ``group``'s contiguous share of a step's indices."""
    if not 0 <= group < num_groups:
        raise ValueError(f"group {group} out of range [0, {num_groups})")
    if len(indices) % num_groups:
        raise DataError(f"global batch {len(indices)} is not divisible by the {num_groups} "
                        "data-parallel groups; make the global batch a multiple of it")
    share = len(indices) // num_groups
    return indices[group * share : (group + 1) * share]


def micro_batches(indices: list[int], micro_batch: int) -> list[list[int]]:
    """Split a group's indices, in order, into micro-batches of ``micro_batch`` sequences."""
    if micro_batch < 1 or len(indices) % micro_batch:
        raise DataError(f"{len(indices)} sequences per data-parallel group cannot be split into "
                        f"micro-batches of {micro_batch}; choose a micro-batch size dividing it")
    return [indices[i : i + micro_batch] for i in range(0, len(indices), micro_batch)]


def sequence_shard(batch: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    """Rank ``index`` of a sequence group's slice ``[index*N, (index+1)*N)`` of every row (dim 1: a
    value per token may have more dims, a rollout's routes), N = seq_len/parts.

    Positions and document ids are sliced with the tokens, so they stay global (per document); a
    None entry (no document ids) stays None.
    """
    return {key: None if value is None else value.chunk(parts, dim=1)[index].contiguous()
            for key, value in batch.items()}


def count_targets(batches: list[dict[str, torch.Tensor]]) -> int:
    """The labels of `batches` that count in the loss (not IGNORE_INDEX)."""
    return sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)


def to_device(batch: dict[str, torch.Tensor | None], device: torch.device) -> dict[str, torch.Tensor | None]:
    """A collated micro-batch on `device` (absent entries stay None)."""
    return {key: value.to(device) if value is not None else None for key, value in batch.items()}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sequence tensors into ``[B, seq_len]`` batches."""
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def load_batch(dataset: PackedDataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """The collated micro-batch of the given sequence indices."""
    return collate([dataset[i] for i in indices])


class Data(NamedTuple):
    """What ``build_data`` returns; unpacks as ``tokenizer, dataset, stream``."""

    tokenizer: AnyTokenizer
    dataset: PackedDataset | ChatDataset | PreferenceDataset | RolloutDataset
    stream: SequenceStream

    def close(self) -> None:
        """Nothing to end (the RL loop's data, `mop.rl.feed.RolloutFeed`, ends its sampling thread)."""


def source_options(d, rollouts: RolloutSettings | None = None) -> dict:
    """The ``load_dataset`` keywords that a run's data settings (``mop.config.DataConfig``) give;
    ``rollouts``: what recorded rollouts are checked against and scaled by (data.format "rollouts")."""
    chat = None if d.format == "text" else ChatSettings(d.tokenizer, d.chat_template, d.skip_invalid, d.format)
    return {"text_field": d.text_field, "bin_dtype": d.bin_dtype, "chat": chat, "overlong": d.overlong,
            "loss_on": d.loss_on, "shared_prompt": d.shared_prompt, "rollouts": rollouts}


def load_dataset(source: str, tok: AnyTokenizer, seq_len: int, seed: int, *, text_field: str = "text",
                 bin_dtype: str = "uint16", chat: ChatSettings | None = None, overlong: str = "drop",
                 loss_on: str = "assistant", shared_prompt: bool = True, rollouts: RolloutSettings | None = None):
    """The packed sequences of a source: text cut every ``seq_len`` tokens (``PackedDataset``); with
    ``chat`` whole conversations packed by best-fit decreasing (``ChatDataset``), or, where its kind
    is "preference", whole preference pairs (``PreferenceDataset``, each prompt once unless not
    ``shared_prompt``), or with ``rollouts`` whole recorded rollouts (``RolloutDataset``). All carry a
    ``fingerprint`` of what they hold and ``stats``, the counts a run reports."""
    if rollouts is not None:
        template = chat.template(required=False)
        encoder = RolloutRows(tok if template is None else template.tokenizer, template, rollouts.shape)
        corpus = read_rollouts(source, encoder, rollouts.scale_rewards, chat.skip_invalid)
        return RolloutDataset(corpus, seq_len, seed, tok.pad_id, rollouts.sequences)
    if chat is None:
        if is_prepared(source):
            raise other_format(source, prepared_kind(source))
        tokens, doc_starts = load_token_stream(source, tok, text_field, bin_dtype)
        return PackedDataset(tokens, doc_starts, seq_len)
    corpus = load_corpus(source, chat)
    if chat.kind == "preference":
        return PreferenceDataset(corpus, seq_len, overlong, seed, tok.pad_id, loss_on, shared_prompt)
    return ChatDataset(corpus, seq_len, overlong, seed, tok.pad_id, loss_on)


def build_data(source: str, tokenizer: str, seq_len: int, seed: int, *,
               text_field: str = "text", bin_dtype: str = "uint16",
               eos_token: str | None = None, chat: ChatSettings | None = None, overlong: str = "drop",
               loss_on: str = "assistant", shared_prompt: bool = True, rollouts: RolloutSettings | None = None) -> Data:
    """Tokenizer, packed dataset and sequence stream from plain settings.

    ``source``: ``"builtin"`` or a local file/directory (see ``sources``; with ``chat``, a conversation
    or preference source or a prepared folder, see ``conversations``, ``preference.rows`` and
    ``prepared``); ``tokenizer``: ``"byte"`` or a local ``tokenizer.json`` (file or directory);
    ``seq_len``: tokens per training sequence;
    ``seed``: the data-order seed (and the packing's); ``text_field``: the JSONL field or parquet
    column holding text; ``bin_dtype``: ``"uint16"`` or ``"uint32"`` for ``.bin`` files;
    ``eos_token``: overrides the tokenizer's document separator; ``chat``: how conversations (or
    preference pairs, its kind "preference") become tokens and targets (None: text); ``overlong``:
    "drop" or "truncate" conversations or pairs longer than ``seq_len``; ``loss_on``: the targets of a
    conversation or response, "assistant" or "all"; ``shared_prompt``: pack a pair's prompt once
    (``mop.data.preference.packing``); ``rollouts``: recorded rollouts' settings (``mop.data.rollouts.corpus``).
    """
    tok = load_tokenizer(tokenizer, eos_token)
    dataset = load_dataset(source, tok, seq_len, seed, text_field=text_field, bin_dtype=bin_dtype, chat=chat,
                           overlong=overlong, loss_on=loss_on, shared_prompt=shared_prompt, rollouts=rollouts)
    stream = SequenceStream(len(dataset), seed, seq_len, dataset.fingerprint)
    return Data(tok, dataset, stream)
