"""Does the job fit? The dry run's per-rank memory estimate against the memory this rank has.

``check_memory_fit(estimate, available, cfg, where)`` compares a ``MemoryEstimate``
(``mhar_titan.dryrun.estimate_memory``, the formula in that module's docstring) with an
available number of bytes and, with ``training.memory_check``:

* ``"error"`` (the default): raises ``MemoryFitError`` (exit 2) when the estimate exceeds
  it, before the model is built, saying by how much and which setting to lower;
* ``"warn"``: returns that sentence as a warning and the run starts anyway;
* ``"off"``: no check.

``available_memory(device, local_ranks)`` measures the number: free device memory on CUDA
(``torch.cuda.mem_get_info``), and on CPU the host's available memory (``MemAvailable`` of
``/proc/meminfo``, else ``os.sysconf`` free pages) shared by the ``local_ranks`` processes of
the node. The estimate is a planning number without headroom (it ignores allocator
fragmentation and workspaces), so a job it calls fitting may still run out; one it calls not
fitting would need at least that much.

What each number covers: the trainer checks the job as it will run on its own device (on CPU:
fp32 compute and the routing implementation that runs there, usually eager, which saves routing
keys); the dry run plans the job for the target device type (``--device cuda`` by default:
``training.mixed_precision_param`` compute and, for routing_kernel "auto" or "triton", the fused
kernels where they fit, whatever the planning machine has installed). The same formula
(``dryrun.estimate_memory``) gives both, so ``python -m mhar_titan.dryrun --device cpu`` prints the
trainer's own CPU number, and a CPU start of a GPU job's config reports a larger estimate than
the GPU plan.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from mhar_titan.errors import UserError

GIB = 2**30


class MemoryFitError(UserError, RuntimeError):
    """The job's memory estimate per rank exceeds the memory the rank has."""


def available_memory(device: torch.device, local_ranks: int = 1) -> tuple[int, str]:
    """(bytes available to one rank on ``device``, where the number comes from).

    CUDA: free memory of the device (``torch.cuda.mem_get_info``). CPU: the host's available
    memory divided by ``local_ranks`` (the training processes sharing the node).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    share = f" / {local_ranks} ranks on this node" if local_ranks > 1 else ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // local_ranks, f"host MemAvailable{share}"
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return pages // local_ranks, f"host free memory{share}"


def memory_fit_message(estimate, available: int, source: str, cfg) -> Optional[str]:
    """None when ``estimate.total`` (bytes per rank) fits in ``available`` bytes, else one sentence
    saying by how much it does not and which settings to lower (``cfg`` is the ``JobConfig``)."""
    if estimate.total <= available:
        return None
    t, ac = cfg.training, cfg.activation_checkpoint.mode
    fixes = (f"lower training.seq_len ({t.seq_len}) or training.local_batch_size ({t.local_batch_size}; gradient "
             "accumulation through training.global_batch_size keeps the batch), ")
    if ac != "full":
        fixes += f"checkpoint activations (activation_checkpoint.mode = \"full\", now {ac!r}), "
    return (f"the job does not fit: its memory estimate per rank is {estimate.total / GIB:,.2f} GiB "
            f"(activations {estimate.activations / GIB:,.2f} GiB; formula in mhar_titan/dryrun.py), "
            f"{(estimate.total - available) / GIB:,.2f} GiB more than the {available / GIB:,.2f} GiB available "
            f"({source}): {fixes}or use more ranks; training.memory_check = \"warn\" starts anyway")


def check_memory_fit(estimate, available: int, source: str, cfg) -> Optional[str]:
    """Apply ``cfg.training.memory_check`` to ``memory_fit_message``: returns the warning to print
    ("warn"), or None (fits, or "off").

    Raises:
        MemoryFitError: the estimate exceeds ``available`` and memory_check is "error".
    """
    mode = cfg.training.memory_check
    if mode == "off":
        return None
    message = memory_fit_message(estimate, available, source, cfg)
    if message is not None and mode == "error":
        raise MemoryFitError(message)
    return message
