"""Chat data (`data.format = "chat"`): conversations rendered with the model's chat template, the
loss on the assistant's tokens.

- `corpus`: a row's conversation encoded into ids and assistant targets (`ChatRows`), and what a
  prepared folder of them counts (`CHAT`);
- `packing`: whole conversations packed into training sequences (`ChatDataset`).

Reading rows and rendering messages (`mop.data.conversations`, `mop.data.templates`) is shared with
the preference and rollout formats.
"""
