"""Preference pairs encoded for training (`mop.data.preference.rows`): item k of a `PreferenceCorpus`
is a pair's prompt, chosen and rejected tokens one after the other (targets 0 on the prompt), `parts
[n, 3]` their lengths, with the degenerate pairs counted (`same_responses`); and what a prepared
folder of pairs counts (`PREFERENCE`, `mop data prepare --format preference`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mop.data.preference.rows import PreferenceRows, same_responses
from mop.data.prepared import Arrays, ChatSettings, Corpus, Kind, histogram
from mop.data.tokenizer import load_tokenizer


@dataclass
class PreferenceCorpus(Corpus):
    """Encoded preference pairs (the module docstring): item k is prompt | chosen | rejected."""

    parts: np.ndarray = field(kw_only=True)
    """int64 [n, 3]: each pair's prompt, chosen and rejected lengths."""
    degenerate_pairs: int = field(kw_only=True, default=0)
    """How many of its pairs are degenerate (`mop.data.preference.rows.same_responses`)."""
    degenerate_examples: list[str] = field(kw_only=True, default_factory=list)
    """Where the first few of them are in the source."""

    @classmethod
    def of(cls, tokens, targets, offsets, fingerprint: str, skipped: int, parts, counts: dict) -> PreferenceCorpus:
        if "degenerate_pairs" in counts:
            degenerate = (counts["degenerate_pairs"], counts["degenerate_examples"])
        else:  # pairs prepared before they were counted
            degenerate = (sum(same_responses(tokens[a:b], p) for a, b, p in zip(offsets[:-1], offsets[1:], parts)), [])
        return cls(tokens, targets, offsets, fingerprint, skipped, parts=parts, degenerate_pairs=degenerate[0],
                   degenerate_examples=degenerate[1])

    def item(self, k: int) -> tuple:
        """Pair k as encoded: `(ids, targets, (p, c, r))`."""
        return *super().item(k), tuple(int(n) for n in self.parts[k])


def _encoder(settings: ChatSettings) -> PreferenceRows:
    template = settings.template(required=False)
    tokenizer = load_tokenizer(settings.tokenizer) if template is None else template.tokenizer
    return PreferenceRows(tokenizer, template, drop_degenerate=settings.skip_invalid)


def _counts(arrays: Arrays) -> dict:
    parts = arrays.parts()
    units = parts.sum(1) + 1  # [P | C] then the branch [P[-1] | R] (mop.data.preference.packing)
    return {"pairs": len(parts), "tokens": int(parts.sum()), "prompt_tokens": int(parts[:, 0].sum()),
            "response_tokens": int(parts[:, 1:].sum()), "targets": arrays.targets, "longest_unit": int(units.max()),
            "unit_length_histogram": histogram(units), "degenerate_pairs": arrays.flagged,
            "degenerate_examples": arrays.flagged_examples}


def _said(m: dict) -> str:
    return (f"{m['pairs']} pairs ({m['prompt_tokens']} prompt and {m['response_tokens']} response tokens, "
            f"{m['degenerate_pairs']} degenerate, ")


PREFERENCE = Kind("mop-preference", "pair", "preference pairs (prompt, chosen, rejected)", _encoder, _counts, _said,
                  corpus=PreferenceCorpus, parts=True, flagged=same_responses)
