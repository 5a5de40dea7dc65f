"""`share_gpu()`: configure GPU memory, or carve devices into logical ones, in one call."""

from __future__ import annotations

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)


def share_gpu(
    memory_growth: bool = True, split: int | None = None, memory_limit_mb: int | None = None
) -> list[str]:
    """Configures the GPUs for sharing; call it first, before TensorFlow uses any device.

    With neither `split` nor `memory_limit_mb`, turns on memory growth so this process
    takes GPU memory as it needs it instead of all of it (the usual first step when
    several processes or models share a GPU). With `split=k`, carves every GPU into `k`
    logical GPUs of `memory_limit_mb` each, so one GPU can hold `k` pipeline stages (each
    logical GPU has its own stream group) or `k` worker processes' budgets. On a machine
    with no GPU, `split=k` carves the CPU into `k` logical CPUs, so code written for
    `/GPU:0`..`/GPU:k-1` can be tried on `/CPU:0`..`/CPU:k-1`.

    Creating a `tf.distribute` strategy initializes the devices, so call it before that.
    The names it returns can be given to a strategy that trains an unplaced model
    (`tf.distribute.MirroredStrategy(devices)`; over logical GPUs TensorFlow all-reduces
    with its ring collectives instead of NCCL); a placed model runs under no strategy.

    Args:
        memory_growth: Whether GPU memory grows on demand, when no limit is set. Defaults
            to `True`.
        split: Number of logical devices to carve each GPU (or, with no GPU, the CPU)
            into. Defaults to `None` (no carving).
        memory_limit_mb: Memory of each logical GPU in MiB; required with `split` on a GPU.
            Without `split` it caps the one logical GPU. Ignored on CPUs. Defaults to
            `None`.

    Returns:
        The names of the logical devices to place work on, e.g. `["/GPU:0", "/GPU:1"]`
        (or `["/CPU:0", ...]` on a machine with no GPU).

    Example:

    ```python
    # At the very top of a script, before any model or tensor is made.
    import keras_gpushare as kg

    devices = kg.share_gpu(split=2, memory_limit_mb=4096)
    ```
    """
    if split is not None and (not isinstance(split, int) or split < 1):
        raise ValueError(
            f"Invalid value for argument `split`: {split!r}. Expected a positive integer "
            "(the number of logical devices per GPU), or None."
        )
    if memory_limit_mb is not None and (
        not isinstance(memory_limit_mb, int) or memory_limit_mb < 1
    ):
        raise ValueError(
            f"Invalid value for argument `memory_limit_mb`: {memory_limit_mb!r}. Expected "
            "a positive integer number of MiB, or None."
        )
    gpus = tf.config.list_physical_devices("GPU")
    try:
        if gpus:
            _configure_gpus(gpus, memory_growth, split, memory_limit_mb)
        elif split is not None:
            split_cpu(split)
    except RuntimeError as e:
        raise RuntimeError(
            "`kg.share_gpu()` was called after TensorFlow initialized its devices, when "
            f"they can no longer be configured ({e}). Call it at the top of the script, "
            "before building any model, tensor, dataset or tf.distribute strategy (and "
            "before `kg.stage`)."
        ) from None
    kind = "GPU" if gpus else "CPU"
    return [f"/{kind}:{i}" for i in range(len(tf.config.list_logical_devices(kind)))]


def split_cpu(count: int) -> list[str]:
    """Carves the CPU into `count` logical CPUs, before TensorFlow initializes its devices.

    `kg.share_gpu(split=k)` does this on a machine with no GPU; `keras-gpushare plan
    --logical-cpus N` does it on any machine, so a plan can be made over `/CPU:0` ..
    `/CPU:N-1`. Once TensorFlow has initialized its devices it raises a `RuntimeError`.

    Args:
        count: Number of logical CPUs.

    Returns:
        Their names, `["/CPU:0", ..., f"/CPU:{count - 1}"]`.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    )
    logger.info("Carved the CPU into %d logical CPUs.", count)
    return [f"/CPU:{i}" for i in range(count)]


def _configure_gpus(
    gpus: list, memory_growth: bool, split: int | None, memory_limit_mb: int | None
) -> None:
    if split is None and memory_limit_mb is None:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, memory_growth)
        logger.info("Memory growth %s on %d GPUs.", memory_growth, len(gpus))
        return
    if memory_limit_mb is None:
        raise ValueError(
            f"Invalid arguments: `split={split}` on a GPU needs `memory_limit_mb`, the "
            "memory of each logical GPU. Pass e.g. `memory_limit_mb=4096` (the logical "
            "GPUs of one physical GPU must fit in its memory together)."
        )
    config = [
        tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
        for _ in range(split or 1)
    ]
    for gpu in gpus:
        tf.config.set_logical_device_configuration(gpu, config)
    logger.info(
        "Carved each of %d GPUs into %d logical GPUs of %d MiB.",
        len(gpus),
        split or 1,
        memory_limit_mb,
    )
