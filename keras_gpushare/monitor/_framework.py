"""This process's GPU memory as the framework's allocator sees it (no NVML).

Used when NVML's process list does not contain this process's PID (inside a container NVML
reports host PIDs) and, at train end, for the per-member memory the advice divides by. Only a
framework that is already imported is asked; TensorFlow is never imported here on purpose.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

logger = logging.getLogger(__name__)

_MIB = 1024.0 * 1024.0


def memory_probe(backend: str) -> tuple[Callable[[], float], Callable[[], float]] | None:
    """Returns `(current_mib, peak_mib)` callables for `backend`, or `None` without a GPU.

    Called on the training thread (device lists are created there); the callables are safe to
    call from the sampler thread.
    """
    try:
        if backend == "tensorflow" and "tensorflow" in sys.modules:
            return _tensorflow_probe(sys.modules["tensorflow"])
        if backend == "jax" and "jax" in sys.modules:
            return _jax_probe(sys.modules["jax"])
        if backend == "torch" and "torch" in sys.modules:
            return _torch_probe(sys.modules["torch"])
    except Exception as e:  # a probe is optional
        logger.debug("no framework memory probe: %s", e)
    return None


def _tensorflow_probe(tf):
    names = [d.name for d in tf.config.list_logical_devices("GPU")]
    if not names:
        return None

    def read(field: str) -> float:
        return sum(tf.config.experimental.get_memory_info(n)[field] for n in names) / _MIB

    return (lambda: read("current")), (lambda: read("peak"))


def _jax_probe(jax):
    devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not devices:
        return None

    def read(field: str) -> float:
        return sum((d.memory_stats() or {}).get(field, 0) for d in devices) / _MIB

    return (lambda: read("bytes_in_use")), (lambda: read("peak_bytes_in_use"))


def _torch_probe(torch):
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()

    def current() -> float:
        return sum(torch.cuda.memory_reserved(i) for i in range(count)) / _MIB

    def peak() -> float:
        return sum(torch.cuda.max_memory_reserved(i) for i in range(count)) / _MIB

    return current, peak
