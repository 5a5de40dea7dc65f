"""Several workers: worker names in the keys, only this worker's replica GPUs, no double count."""

import json
import logging
import math
import types

import keras
import pytest
import tensorflow as tf
from fake_nvml import h100s
from monitor_helpers import join_monitor_threads, tiny_data, tiny_model

from keras_gpushare.callbacks import UtilizationLogger
from keras_gpushare.monitor import _workers
from keras_gpushare.monitor._workers import ReplicaGpu, replica_gpus, worker_name

GPU_SUFFIXES = ("util", "util_max", "mem_used_mib", "mem_util", "power_w", "temp_c")
HOST_KEYS = ("cpu_util", "host_mem_used_mib")


def tf_config(task_type, index, cluster):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


TWO_WORKERS = {"worker": ["host-a:2222", "host-b:2222"]}


def fit(util_logger, model=None, epochs=2):
    x, y = tiny_data(16)
    model = model or tiny_model()
    history = model.fit(x, y, batch_size=8, epochs=epochs, callbacks=[util_logger], verbose=0)
    return {key: values for key, values in history.history.items() if key != "loss"}


def keys_for(prefix, gpu_keys):
    gpu = [f"{prefix}gpu{i}_{s}" for i in gpu_keys for s in GPU_SUFFIXES]
    procs = [f"{prefix}proc_gpu_mem_mib"] if gpu_keys else []
    return set(gpu + procs + [f"{prefix}{k}" for k in HOST_KEYS])


def own_warnings(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("keras_gpushare.monitor")
    ]


def mean_util(samples, raw_key):
    values = [s[raw_key] for s in samples if not math.isnan(s[raw_key])]
    return sum(values) / len(values)


# ---------------------------------------------------------------------- worker names in keys


def test_worker_one_of_two_prefixes_every_key(fake_nvml, monkeypatch, caplog):
    fake = fake_nvml(h100s(2))
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 1, TWO_WORKERS))
    util_logger = UtilizationLogger(interval=0.02)
    with caplog.at_level(logging.INFO, logger="keras_gpushare.monitor"):
        logs = fit(util_logger)
    assert set(logs) == keys_for("worker1_", [0, 1])
    assert util_logger.worker_name == "worker1"
    # The figures are those of the raw (unprefixed) samples of the last epoch window.
    assert logs["worker1_gpu1_util"][-1] == pytest.approx(
        mean_util(util_logger.epoch_samples, "gpu1_util"), rel=1e-12
    )
    assert [d["key"] for d in util_logger.monitored_devices] == ["worker1_gpu0", "worker1_gpu1"]
    assert util_logger.advice.startswith("UtilizationLogger (worker1): GPU 0 busy")
    messages = [r.getMessage() for r in caplog.records]
    assert f"worker1: monitoring gpu1: NVML index 1, {fake.gpus[1].name}, {fake.gpus[1].uuid}" in (
        messages
    )
    assert util_logger.advice in messages


def test_chief_is_named_chief0(fake_nvml, monkeypatch):
    fake_nvml(h100s(1))
    cluster = {"chief": ["host-a:2222"], "worker": ["host-b:2222"]}
    monkeypatch.setenv("TF_CONFIG", tf_config("chief", 0, cluster))
    logs = fit(UtilizationLogger(interval=0.02), epochs=1)
    assert set(logs) == keys_for("chief0_", [0])


def test_single_task_tf_config_keeps_plain_keys(fake_nvml, monkeypatch):
    fake_nvml(h100s(1))
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 0, {"worker": ["localhost:2222"]}))
    util_logger = UtilizationLogger(interval=0.02)
    logs = fit(util_logger, epochs=1)
    assert set(logs) == keys_for("", [0])
    assert util_logger.worker_name is None
    assert util_logger.advice.startswith("UtilizationLogger: GPU 0 busy")


def test_worker_none_and_a_forced_name(fake_nvml, monkeypatch):
    fake_nvml(h100s(1))
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 1, TWO_WORKERS))
    assert set(fit(UtilizationLogger(interval=0.02, worker=None), epochs=1)) == keys_for("", [0])
    monkeypatch.delenv("TF_CONFIG")
    forced = UtilizationLogger(interval=0.02, worker="host3", every=1)
    x, y = tiny_data(16)
    batch_keys = []
    batches = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: batch_keys.append(set(logs))
    )
    history = tiny_model().fit(x, y, batch_size=8, epochs=1, callbacks=[forced, batches], verbose=0)
    assert set(history.history) - {"loss"} == keys_for("host3_", [0])
    assert all(keys - {"loss"} == keys_for("host3_", [0]) for keys in batch_keys)


def test_warnings_name_the_worker(fake_nvml, monkeypatch, caplog):
    fake_nvml(h100s(1), init_error=9)
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 1, TWO_WORKERS))
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        logs = fit(UtilizationLogger(interval=0.02), epochs=1)
    warnings = own_warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith("worker1: no GPU figures")
    assert set(logs) == {f"worker1_{k}" for k in HOST_KEYS}


def test_malformed_tf_config_warns_and_keeps_plain_keys(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        assert worker_name(None, "{not json") is None
    assert "TF_CONFIG is not valid JSON" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "config, want",
    [
        (None, None),
        ("", None),
        (tf_config("worker", 1, TWO_WORKERS), "worker1"),
        (tf_config("worker", "1", TWO_WORKERS), "worker1"),
        (tf_config("chief", 0, {"chief": ["a:1"], "worker": ["b:1", "c:1"]}), "chief0"),
        (tf_config("worker", 0, {"worker": ["a:1"]}), None),
        (tf_config("worker", 0, {"worker": {"0": "a:1", "3": "b:1"}}), "worker0"),
        (json.dumps({"cluster": TWO_WORKERS}), None),  # no task: which worker is unknown
    ],
)
def test_worker_name_from_tf_config(config, want):
    assert worker_name(None, config) == want


def test_worker_name_prefers_the_strategy_resolver(monkeypatch):
    two = tf.train.ClusterSpec(TWO_WORKERS)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        two, task_type="worker", task_id=1
    )
    strategy = types.SimpleNamespace(cluster_resolver=resolver)
    one_worker = tf_config("worker", 0, {"worker": ["localhost:2222"]})
    assert worker_name(strategy, one_worker) == "worker1"
    single = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["a:1"]}), task_type="worker", task_id=0
    )
    multi = tf_config("worker", 1, TWO_WORKERS)
    assert worker_name(types.SimpleNamespace(cluster_resolver=single), multi) is None
    # A resolver that knows no task (MultiWorkerMirroredStrategy without TF_CONFIG, or
    # MirroredStrategy's None) leaves it to TF_CONFIG.
    assert worker_name(types.SimpleNamespace(cluster_resolver=None), multi) == "worker1"
    # TensorFlow's own TF_CONFIG resolver, as MultiWorkerMirroredStrategy holds it.
    monkeypatch.setenv("TF_CONFIG", tf_config("worker", 1, TWO_WORKERS))
    tf_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert worker_name(types.SimpleNamespace(cluster_resolver=tf_resolver), None) == "worker1"


# ---------------------------------------------------------------------- replica devices


@pytest.mark.parametrize(
    "names, visible, want",
    [
        (["/job:localhost/replica:0/task:0/device:GPU:1"], None, [ReplicaGpu(1, 1, 1)]),
        (
            ["/job:localhost/replica:0/task:0/device:GPU:0", "/device:GPU:1"],
            "2,3",
            [ReplicaGpu(0, 0, 2), ReplicaGpu(1, 1, 3)],
        ),
        (["/gpu:1"], "GPU-aaaa, GPU-bbbb", [ReplicaGpu(1, 1, "GPU-bbbb")]),
        (["/GPU:0"], "MIG-cccc", [ReplicaGpu(0, 0, "MIG-cccc")]),
        (["/device:GPU:1"], "0", [ReplicaGpu(1, 1, None)]),  # CUDA_VISIBLE_DEVICES too short
        (["/device:GPU:1"], "3,bogus,2", [ReplicaGpu(1, 1, None)]),  # CUDA stops at "bogus"
        (["/job:localhost/replica:0/task:0/device:CPU:0", "/device:CPU:1"], None, []),
        ([], "0,1", []),
    ],
)
def test_replica_gpus_through_cuda_visible_devices(names, visible, want):
    assert replica_gpus(names, visible) == want


def test_replica_gpus_keep_this_task_only():
    names = [
        "/job:worker/replica:0/task:0/device:GPU:0",
        "/job:worker/replica:0/task:1/device:GPU:0",
        "/job:worker/replica:0/task:1/device:GPU:1",
        "/job:chief/replica:0/task:1/device:GPU:2",
    ]
    assert replica_gpus(names, "4,5,6", task=("worker", 1)) == [
        ReplicaGpu(0, 0, 4),
        ReplicaGpu(1, 1, 5),
    ]
    assert [g.key for g in replica_gpus(names, None, task=("worker", 0))] == [0]
    assert len(replica_gpus(names[:2], None)) == 1  # no task: one GPU:0, counted once


def test_replica_gpus_follow_tensorflow_visible_and_virtual_devices():
    # tf.config.set_visible_devices(gpus[1]): TensorFlow's GPU:0 is CUDA's device 1.
    one = replica_gpus(["/device:GPU:0"], "4,5", logical_to_physical=[1])
    assert one == [ReplicaGpu(0, 1, 5)]
    # Two virtual GPUs on CUDA device 0 and one on device 1: device 0 is sampled once.
    names = ["/device:GPU:0", "/device:GPU:1", "/device:GPU:2"]
    assert replica_gpus(names, None, logical_to_physical=[0, 0, 1]) == [
        ReplicaGpu(0, 0, 0),
        ReplicaGpu(2, 1, 1),
    ]


def test_replica_devices_of_real_strategies():
    default = tiny_model().distribute_strategy
    assert _workers.replica_devices(default) == []
    assert _workers.strategy_gpus(default) == []
    mirrored = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    assert _workers.replica_devices(mirrored) == [
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    ]
    assert _workers.strategy_gpus(mirrored) == []
    assert _workers.strategy_task(mirrored) is None
    assert _workers.tf_logical_to_physical() == []  # this machine: TensorFlow sees no GPU


def fake_strategy(names, task_id=1):
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(TWO_WORKERS), task_type="worker", task_id=task_id
    )
    return types.SimpleNamespace(
        cluster_resolver=resolver, extended=types.SimpleNamespace(worker_devices=tuple(names))
    )


def test_only_the_replica_gpus_of_this_worker_are_sampled(fake_nvml, monkeypatch):
    gpus = h100s(4)
    fake = fake_nvml(gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2,1,0")
    strategy = fake_strategy(["/job:worker/replica:0/task:1/device:GPU:1"])
    monkeypatch.setattr(_workers, "model_strategy", lambda model: strategy)
    util_logger = UtilizationLogger(interval=0.02)
    logs = fit(util_logger)
    assert set(logs) == keys_for("worker1_", [1])
    assert [(d["key"], d["uuid"]) for d in util_logger.monitored_devices] == [
        ("worker1_gpu1", gpus[2].uuid)  # GPU:1 is the second CUDA_VISIBLE_DEVICES entry
    ]
    assert fake.values(gpus[2].uuid, "util")
    assert not any(fake.values(gpus[i].uuid, "util") for i in (0, 1, 3))
    util = [s["gpu1_util"] for s in util_logger.epoch_samples]
    assert util == fake.values(gpus[2].uuid, "util")[-len(util) :]


def test_two_workers_on_one_host_sample_one_gpu_each(fake_nvml, monkeypatch):
    # Each worker ran tf.config.set_visible_devices(gpus[task_id]): its GPU:0 differs.
    gpus = h100s(2)
    fake = fake_nvml(gpus)
    for task_id in (0, 1):
        strategy = fake_strategy([f"/job:worker/replica:0/task:{task_id}/device:GPU:0"], task_id)
        monkeypatch.setattr(_workers, "model_strategy", lambda model, s=strategy: s)
        monkeypatch.setattr(_workers, "tf_logical_to_physical", lambda t=task_id: [t])
        util_logger = UtilizationLogger(interval=0.02)
        before = len(fake.values(gpus[1 - task_id].uuid, "util"))
        logs = fit(util_logger, epochs=1)
        assert set(logs) == keys_for(f"worker{task_id}_", [0])
        assert util_logger.monitored_devices[0]["uuid"] == gpus[task_id].uuid
        assert len(fake.values(gpus[1 - task_id].uuid, "util")) == before  # not sampled


def test_replica_gpu_that_nvml_lacks_leaves_host_figures(fake_nvml, monkeypatch, caplog):
    fake_nvml(h100s(1))
    strategy = fake_strategy(["/job:worker/replica:0/task:1/device:GPU:3"])
    monkeypatch.setattr(_workers, "model_strategy", lambda model: strategy)
    with caplog.at_level(logging.WARNING, logger="keras_gpushare.monitor"):
        logs = fit(UtilizationLogger(interval=0.02), epochs=1)
    assert set(logs) == keys_for("worker1_", [])
    warnings = own_warnings(caplog)
    assert any("GPU:3 is CUDA device 3, but only 1 GPU(s)" in w for w in warnings)
    assert any("no GPU of the distribution strategy's replicas" in w for w in warnings)


def test_explicit_devices_ignore_the_strategy(fake_nvml, monkeypatch):
    gpus = h100s(2)
    fake_nvml(gpus)
    strategy = fake_strategy(["/job:worker/replica:0/task:1/device:GPU:1"])
    monkeypatch.setattr(_workers, "model_strategy", lambda model: strategy)
    util_logger = UtilizationLogger(interval=0.02, devices=[0])
    assert set(fit(util_logger, epochs=1)) == keys_for("worker1_", [0])
    assert util_logger.monitored_devices[0]["uuid"] == gpus[0].uuid


def test_fit_under_mirrored_strategy_on_cpus_logs_every_gpu(fake_nvml):
    gpus = h100s(2)
    fake = fake_nvml(gpus)
    # No collective all-reduce: a second collective strategy in one process reuses the first
    # one's collective keys (tests/distribute keeps one for the whole process).
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = tiny_model()
    util_logger = UtilizationLogger(interval=0.02)
    logs = fit(util_logger, model=model)
    # CPU replicas name no GPU: every visible GPU, plain keys, as without a strategy.
    assert set(logs) == keys_for("", [0, 1])
    assert len(logs["gpu0_util"]) == 2
    assert logs["gpu0_util"][-1] == pytest.approx(
        mean_util(util_logger.epoch_samples, "gpu0_util"), rel=1e-12
    )
    assert fake.values(gpus[1].uuid, "util")
    assert not join_monitor_threads()


# ---------------------------------------------------------------------- arguments and docs


@pytest.mark.parametrize(
    "worker, error, match",
    [
        (1, TypeError, "argument `worker`: got int"),
        (b"worker1", TypeError, "argument `worker`: got bytes"),
        ("", ValueError, "argument `worker`: got ''"),
        ("worker 1", ValueError, "argument `worker`: got 'worker 1'"),
        ("1worker", ValueError, "starts with a letter"),
    ],
)
def test_invalid_worker_is_rejected_at_construction(worker, error, match):
    with pytest.raises(error, match=match):
        UtilizationLogger(worker=worker)
