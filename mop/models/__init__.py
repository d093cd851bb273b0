"""The model, with no collectives: what one step computes on a rank's tokens.

A micro-batch's path through `MoETransformer.loss_terms` (transformer.py):
1. the document ids become `Documents` once per forward (the `documents` seam; documents.py), and
   positions restart at every document;
2. the embedding, then each block: RMSNorm, the family's attention (projections, RoPE at global
   positions, then the `core` seam that mixes the sequence within each document), RMSNorm, and an
   MoE layer (moe.py: the router's top-k, the `Experts` seam, the shared expert) or a dense MLP;
3. the final norm and the `LMHead` seam: the summed cross-entropy over the rank's targets;
4. the router sums pass the `router_sums` seam, and `objective` divides the sums by the step's
   global counts, so any layout and micro-batching computes the same objective.
A parallel layout (`mop.parallel`) swaps only the seams. A family (`families.py`, one folder each)
supplies the attention, the shape spec (spec.py) and the Hugging Face mapping (hf_mapping.py, hf.py);
README.md here says what a new family owns and may extend.
"""
