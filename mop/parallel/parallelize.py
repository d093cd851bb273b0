"""`parallelize(model, layout)`: apply each parallel technique of the `mop` strategy, in order.

Order (each step only touches the modules it owns):
1. sequence parallelism swaps `Attention.core` (not yet: issue 3),
2. expert parallelism swaps `Experts` and shards expert weights over the expert-replica groups
   (not yet: issue 4),
3. the vocabulary-parallel loss swaps `LMHead` (not yet: issue 5),
4. FSDP2 shards whatever dense weights remain over the world mesh (last, because `fully_shard`
   must see the final module tree).

Techniques that have not landed raise NotImplementedError when their sub-group size is > 1, so
a layout can never silently run something other than what it says.
"""

from __future__ import annotations

import torch

from mop.models.transformer import MoETransformer
from mop.parallel.fsdp import shard_dense
from mop.parallel.mesh import DistLayout

_PENDING = {
    "sequence": "Ulysses sequence parallelism (issue 3)",
    "expert": "expert parallelism / LLEP (issue 4)",
    "vocab": "the vocabulary-parallel loss (issue 5)",
}


def parallelize(model: MoETransformer, layout: DistLayout, compute_dtype: torch.dtype = torch.float32) -> MoETransformer:
    sizes = {"sequence": layout.layout.sequence, "expert": layout.layout.expert, "vocab": layout.layout.vocab}
    for name, size in sizes.items():
        if size > 1:
            raise NotImplementedError(f"parallel.{name}={size} needs {_PENDING[name]}, which has not landed yet; "
                                      f"run with --parallel.{name}=1")
    shard_dense(model, layout, compute_dtype)
    return model
