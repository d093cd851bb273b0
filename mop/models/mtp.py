"""DeepSeek-V3's multi-token prediction (MTP): D modules after the last block, depth k predicting
the token k + 1 places after each position.

Depth k (1..D) at position i (the DeepSeek-V3 report, section 2.2; the modules as vLLM and SGLang
serve them):
    h'_i  = eh_proj([enorm(embed(t_{i+k})) ; hnorm(h^{k-1}_i)])      (the embedding first)
    h^k_i = block_k(h'_i)                                             (a decoder block, MoE)
    t_{i+k+1} is predicted by lm_head(norm_k(h^k_i))
with h^0 the main model's final-norm hidden state (what the engines feed their MTP layer), and the
embedding and the output projection the main model's own. The objective adds `mtp_loss_coef / D x
sum_k` depth k's cross-entropy summed over its targets over the step's count of them
(`MoETransformer.objective`). A target t_{i+k+1} counts when t_i and t_{i+k} lie in one document
and its label is not ignored; positions restart at every document, so that is `position(i+k) >= k`,
and each rank counts its own depth-k targets from its own tokens before any forward
(`mop.models.transformer.mtp_targets`).

Positions: depth k's block rotates position i by i (vLLM by i + k): RoPE sees only the differences
within a document, the same either way. The last k positions of a document embed the next
document's tokens (past the row: token 0): no later position of theirs attends them, their targets
are ignored and the depth's block computes them as padding (out of the router sums and expert
counts). A depth's block counts in the load-balancing loss and the expert statistics like the
model's last MoE layers (its rows follow theirs).

The seam: `MoETransformer.lookahead` gives each token the ids, labels and positions of the D tokens
after it. A rank holding whole rows has them in its rows; sequence parallelism, whose ranks hold
slices, swaps it for one that all-gathers the first D tokens of every slice, once per forward
(`mop.parallel.ulysses.SequenceLookahead`).
"""

from __future__ import annotations

import torch
from torch import nn

from mop.models.layers import RMSNorm
from mop.models.shape import ModelShape


class MtpModule(nn.Module):
    """One depth's own weights (its block is `MoETransformer.layers[layers + k - 1]`): the norms of the
    embedding (`enorm`) and of the previous depth's hidden state (`hnorm`), their projection
    `eh_proj [H, 2H]`, and the norm before the shared output projection (`norm`, shared_head.norm)."""

    def __init__(self, cfg: ModelShape):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The block's input `h'` from the previous depth's hidden state and the embedded tokens k ahead."""
        return self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))


class TokenLookahead(nn.Module):
    """The model's seam (module docstring): `rows [P, B, N]` (integer rows of the rank's tokens) ->
    `[P, B, N + depth]`, each row followed by the `depth` tokens after its last; here the rank holds
    whole rows, so nothing follows them (-1)."""

    def forward(self, rows: torch.Tensor, depth: int) -> torch.Tensor:
        return torch.cat([rows, rows.new_full((*rows.shape[:-1], depth), -1)], dim=-1)
