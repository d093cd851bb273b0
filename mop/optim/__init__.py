"""The optimizer the trainer steps through one interface (optimizer.py), and the lr schedule.

A step's gradients and update: torch AdamW (`DeviceAdamW`) lets autograd and FSDP2 leave each
gradient shard on the device until `step`, then clips by the global norm and updates there. The
host optimizer (`HostOptimizer`) hands each gradient shard to `HostAdamW` (host_adamw.py) as soon
as FSDP2 has reduced it (pipeline.py), accumulates in fp32 host memory, speculates the update
while the backward goes on, and settles it once the global norm is known, behind the next
forward, which waits block by block only for what it reads.
"""
