"""Preference pairs (`data.format = "preference"`, DPO): TRL's rows, each pair packed with its
prompt once.

- `rows`: TRL's explicit and implicit rows read, checked and encoded into prompt, chosen and
  rejected tokens (`PreferenceRows`), degenerate pairs told (`same_responses`);
- `corpus`: the encoded pairs (`PreferenceCorpus`), and what a prepared folder of them counts
  (`PREFERENCE`);
- `packing`: pairs packed into training sequences with each prompt computed once
  (`PreferenceDataset`).
"""
