"""The cost model of a training step, from its settings alone: what `mop train`'s fit
(`mop.settle.fit`) and `mop plan` (`mop.plan`) score layouts with. It sits below `mop.build` and
reads the trainer's own rules (the model built on the meta device, the placement record, the
dtypes of `mop.config.Config`), never a run.

- `memory`: per-rank device memory at a step's four moments, by the paper's Table 3 rows, and host
  memory per node; `activations`: what each option keeps between the passes;
- `speed`: the roofline step time (compute, links, what overlaps);
- `candidates`: a layout scored (fits, tokens/s) and the pick among layouts;
- `cluster`: node presets and the local machine as a cluster.
"""
