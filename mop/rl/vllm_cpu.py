"""A vLLM worker extension for its CPU build (0.32): in-place weight reloads that load the MoE experts right,
and a worker that asks for AMX before its kernels run.

vLLM reloads a running model's weights layer by layer (`/collective_rpc reload_weights`, the CPU build's
only sync path: `mop.rl.senders.VLLMFolderSender`), running each layer's post-processing again; but
`UnquantizedFusedMoEMethod._setup_kernel` skips its experts' `process_weights_after_loading` once the layer
has a kernel (`is_weight_update`, `layers/fused_moe/unquantized_fused_moe_method.py:187-205`), and on the
CPU that is the experts' padding and AMX prepacking (`experts/cpu_moe.py:208-218`). The reloaded experts
then reach the kernel unpacked: wrong log-probs (measured: 5-8 nats off after reloading the same
weights), or a reload that fails where the intermediate width is padded. GPU builds prepack nothing there.

Its worker also died now and then at its first forward (SIGILL: 7 of 14 starts of a server of the RL toy
task's model on this machine). Linux lets a process run AMX instructions only once it has asked for them
(`ARCH_REQ_XCOMP_PERM`), and the worker's own kernels use AMX before anything asks, it seems; the import
asks (`torch.cpu._init_amx`), and no worker has died since (the engine tier's runs included).

Start the server with `--worker-extension-cls mop.rl.vllm_cpu.ReloadFix` and mop's directory on its
PYTHONPATH (this module imports only vLLM and torch): the import, in each worker before its model loads,
makes a reload run the experts' post-processing as the first load does (tested: reloaded weights give a
fresh server's log-probs bit for bit, `tests/test_engine_vllm.py`); `mop_reload_fix` tells a sender the
extension is there. Imported without vLLM (mop's own environment) it patches nothing.
"""

from __future__ import annotations

try:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
except ImportError:  # mop's own environment
    unquantized_fused_moe_method = None

EXTENSION = f"{__name__}.ReloadFix"
"""The server's `--worker-extension-cls`."""


class ReloadFix:
    """The worker extension (module docstring): its methods are the worker's, called by `/collective_rpc`."""

    def mop_reload_fix(self) -> str:
        return EXTENSION


def _setup_kernel_on_reload(setup_kernel):
    def setup(self, layer, w13, w2):
        reloading = self.moe_kernel is not None
        setup_kernel(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if reloading and isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)  # pad and prepack, as at the first load

    return setup


if unquantized_fused_moe_method is not None:
    import torch

    torch.cpu._init_amx()  # the process's permission to run AMX instructions, before any kernel does
    _method = unquantized_fused_moe_method.UnquantizedFusedMoEMethod
    if not getattr(_method, "_mop_reload_fix", False):
        _method._setup_kernel = _setup_kernel_on_reload(_method._setup_kernel)
        _method._mop_reload_fix = True
