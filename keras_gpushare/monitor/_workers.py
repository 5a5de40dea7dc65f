"""Several workers: which worker this process is, and which GPUs its replicas use.

Under `tf.distribute.MultiWorkerMirroredStrategy` every worker runs the same script and its
own callbacks. `worker_name` names this worker (`"worker1"`, `"chief0"`) so that the figures of
different workers never share a key, and `replica_gpus` maps the strategy's replica devices on
this worker to CUDA's device numbers, so that two workers on one host that each use one GPU do
not both sample every GPU. The two functions are pure; `model_strategy`, `replica_devices` and
`tf_logical_to_physical` read what they need from TensorFlow when it is already imported
(TensorFlow is never imported here).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from keras_gpushare.monitor.nvml import parse_cuda_visible_devices

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# `/job:worker/replica:0/task:1/device:GPU:1`, `/device:GPU:0`, `/GPU:0`, `/gpu:0`.
_DEVICE = re.compile(
    r"(?:/job:(?P<job>[^/]+))?(?:/replica:\d+)?(?:/task:(?P<task>\d+))?"
    r"/(?:device:)?(?P<type>[A-Za-z_]+):(?P<index>\d+)",
)
_LOCAL_JOB = "localhost"


@dataclasses.dataclass(frozen=True)
class ReplicaGpu:
    """A GPU one of the strategy's replicas on this worker runs on.

    Attributes:
        key: the framework's GPU number in the replica's device name (`GPU:key`); the figures
            are named `gpu{key}_*`.
        cuda_ordinal: CUDA's number of the physical device among those `CUDA_VISIBLE_DEVICES`
            shows (differs from `key` after `tf.config.set_visible_devices`).
        visible_entry: the `CUDA_VISIBLE_DEVICES` entry that device is (an index or a UUID),
            the ordinal itself when the variable is unset, `None` when it lists too few.
    """

    key: int
    cuda_ordinal: int
    visible_entry: int | str | None


def worker_name(strategy: Any = None, tf_config: str | None = None) -> str | None:
    """`"worker1"`, `"chief0"`, ...: this worker's name when training runs on several.

    The strategy's cluster resolver decides when it knows this task
    (`MultiWorkerMirroredStrategy` has `cluster_resolver.task_type` and `task_id`); otherwise
    the `TF_CONFIG` text does. Either way, a cluster of one task is not "several workers" and
    gives `None`, as do no strategy and no `TF_CONFIG`.

    Args:
        strategy: a `tf.distribute.Strategy` (anything with `cluster_resolver`) or `None`.
            Defaults to `None`.
        tf_config: the `TF_CONFIG` environment variable's value, `None` when unset. Defaults
            to `None`.

    Returns:
        The name (task type and index), or `None` for a single worker.
    """
    resolver = _safe_getattr(strategy, "cluster_resolver")
    task_type = _safe_getattr(resolver, "task_type")
    task_id = _safe_getattr(resolver, "task_id")
    if task_type is not None and task_id is not None:
        try:
            cluster = resolver.cluster_spec().as_dict()
        except Exception as e:  # a resolver that cannot say is one worker
            logger.debug("cluster resolver gave no cluster spec: %s", e)
            cluster = {}
        return _name(task_type, task_id, cluster, "the strategy's cluster resolver")
    if not tf_config or not tf_config.strip():
        return None
    try:
        config = json.loads(tf_config)
    except ValueError as e:
        logger.warning("TF_CONFIG is not valid JSON (%s); the keys name no worker.", e)
        return None
    if not isinstance(config, dict):
        return None
    task = config.get("task") or {}
    cluster = config.get("cluster") or {}
    if not isinstance(task, dict) or not isinstance(cluster, dict):
        return None
    return _name(task.get("type"), task.get("index", 0), cluster, "TF_CONFIG")


def replica_gpus(
    device_names: Sequence[str],
    cuda_visible_devices: str | None,
    *,
    task: tuple[str, int] | None = None,
    logical_to_physical: Sequence[int] | None = None,
) -> list[ReplicaGpu]:
    """Maps replica device names to the GPUs CUDA numbers, for this worker only.

    Args:
        device_names: the strategy's replica devices (`strategy.extended.worker_devices`),
            e.g. `"/job:worker/replica:0/task:1/device:GPU:1"`. CPU and other devices are
            left out; so are devices of another task than `task`.
        cuda_visible_devices: the `CUDA_VISIBLE_DEVICES` value, `None` when unset.
        task: `(job, index)` of this worker, or `None` to keep every task's devices.
            `localhost` devices are always this worker's. Defaults to `None`.
        logical_to_physical: for each of TensorFlow's logical GPUs (`GPU:i`), the CUDA ordinal
            of its physical device (see `tf_logical_to_physical`); `None` when `GPU:i` is
            CUDA's device `i`. Defaults to `None`.

    Returns:
        One `ReplicaGpu` per physical device, in the order of the replica names; two logical
        GPUs on one physical device give one entry (the first), so nothing is counted twice.
        Empty when no replica runs on a GPU.
    """
    entries = None
    if cuda_visible_devices is not None:
        entries, _ = parse_cuda_visible_devices(cuda_visible_devices)
    gpus: list[ReplicaGpu] = []
    for name in device_names:
        match = _DEVICE.search(name)
        if match is None or match["type"].upper() != "GPU":
            continue
        if _other_task(match["job"], match["task"], task):
            continue
        key = int(match["index"])
        ordinal = key
        if logical_to_physical is not None and key < len(logical_to_physical):
            ordinal = int(logical_to_physical[key])
        if any(g.cuda_ordinal == ordinal for g in gpus):
            continue
        if entries is None:
            entry: int | str | None = ordinal
        else:
            entry = entries[ordinal] if ordinal < len(entries) else None
        gpus.append(ReplicaGpu(key, ordinal, entry))
    return gpus


def model_strategy(model: Any) -> Any | None:
    """The model's `tf.distribute.Strategy` on the TensorFlow backend, else `None`."""
    if "tensorflow" not in sys.modules:
        return None
    return _safe_getattr(model, "distribute_strategy")


def replica_devices(strategy: Any) -> list[str]:
    """The strategy's replica device names on this worker; empty for TensorFlow's default
    strategy (which has none) and for anything that is not a strategy."""
    extended = _safe_getattr(strategy, "extended")
    try:
        names = extended.worker_devices if extended is not None else ()
    except Exception as e:  # the default strategy raises RuntimeError
        logger.debug("strategy has no worker devices: %s", e)
        return []
    return [str(n) for n in names or ()]


def strategy_task(strategy: Any) -> tuple[str, int] | None:
    """`(task_type, task_id)` from the strategy's cluster resolver, `None` when unknown."""
    resolver = _safe_getattr(strategy, "cluster_resolver")
    task_type = _safe_getattr(resolver, "task_type")
    task_id = _safe_getattr(resolver, "task_id")
    if task_type is None or task_id is None:
        return None
    return str(task_type), int(task_id)


def tf_logical_to_physical() -> list[int] | None:
    """For each of TensorFlow's logical GPUs, the CUDA ordinal of its physical device.

    Follows `tf.config.set_visible_devices` and virtual devices
    (`set_logical_device_configuration`). `None` when TensorFlow is not imported or the
    mapping is not certain (virtual devices with explicit ordinals).
    """
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    try:
        mapping: list[int] = []
        for device in tf.config.get_visible_devices("GPU"):
            ordinal = int(device.name.rsplit(":", 1)[1])
            configs = tf.config.get_logical_device_configuration(device) or [None]
            if any(getattr(c, "experimental_device_ordinal", None) is not None for c in configs):
                return None
            mapping += [ordinal] * len(configs)
    except Exception as e:  # the mapping only narrows what is sampled
        logger.debug("no logical-to-physical GPU mapping: %s", e)
        return None
    return mapping


def strategy_gpus(strategy: Any) -> list[ReplicaGpu]:
    """`replica_gpus` for a live strategy: its replica devices on this worker, TensorFlow's
    logical-to-physical GPU mapping and this process's `CUDA_VISIBLE_DEVICES`."""
    names = replica_devices(strategy)
    if not names:
        return []
    return replica_gpus(
        names,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        task=strategy_task(strategy),
        logical_to_physical=tf_logical_to_physical(),
    )


def _name(task_type: Any, task_id: Any, cluster: Mapping[str, Any], source: str) -> str | None:
    tasks = 0
    for members in cluster.values():
        try:
            tasks += len(members)
        except TypeError:
            tasks += 1
    if tasks <= 1:
        return None
    name = f"{task_type}{task_id}"
    if not isinstance(task_type, str) or not NAME_PATTERN.fullmatch(name):
        logger.warning(
            "%s names this task %r, which is not a task type and index (such as worker1); "
            "the keys name no worker.",
            source,
            name,
        )
        return None
    return name


def _other_task(job: str | None, task_index: str | None, task: tuple[str, int] | None) -> bool:
    """Whether a device name's job and task are another worker's than `task`."""
    if task is None or job is None or job == _LOCAL_JOB:
        return False
    return job != task[0] or (task_index is not None and int(task_index) != task[1])


def _safe_getattr(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    try:
        return getattr(obj, name, None)
    except Exception as e:  # properties of TensorFlow objects may raise
        logger.debug("%s.%s unavailable: %s", type(obj).__name__, name, e)
        return None
