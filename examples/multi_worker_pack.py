"""A ModelPack trained by several workers with MultiWorkerMirroredStrategy.

Run without arguments, the script launches itself as two local workers
(`kg.run_local_workers`, the same as `keras-gpushare workers -n 2 -- python ...`), each with
its own TF_CONFIG on loopback ports, and restarts both if one dies: a BackupAndRestore
callback then resumes training from the last epoch it backed up. On real machines, start
`python examples/multi_worker_pack.py --worker` on each one with TF_CONFIG naming all of
them (docs/scaling.md).

    python examples/multi_worker_pack.py                 # two local workers
    python examples/multi_worker_pack.py --workers 3     # three
"""

import argparse
import json
import os
import sys
import tempfile

import keras
import numpy as np
import tensorflow as tf

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run


def build(width: int) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def train(out_dir: str) -> None:
    """One worker's part: the same script runs on every worker."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    samples, epochs = (512, 2) if QUICK else (50_000, 8)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")

    with strategy.scope():  # the pack and its optimizers live on every worker's replicas
        pack = kg.ModelPack([build(w) for w in (16, 32, 64, 128)])
        pack.compile(
            optimizer=[keras.optimizers.Adam(lr) for lr in (1e-3, 3e-3, 1e-3, 3e-3)],
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    history = pack.fit(
        x,
        y,
        batch_size=256,  # the global batch: each worker trains on its share
        epochs=epochs,
        validation_split=0.1,
        callbacks=[
            keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
            kg.callbacks.MemberEarlyStopping(monitor="val_loss", patience=2),
        ],
        verbose=0,
    )
    pack.save(os.path.join(out_dir, "pack.keras"))  # on every worker; the chief writes it
    if task["index"] == 0:
        best = int(np.argmin([history.history[f"val_m{i}_loss"][-1] for i in range(4)]))
        print(f"{pack.engine} engine, status {pack.status}, best member {best}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help="run as one worker (TF_CONFIG set)")
    parser.add_argument("--workers", type=int, default=2, help="local workers to launch")
    parser.add_argument("--out", default=None, help="folder for the backup and pack.keras")
    args = parser.parse_args()
    if args.worker:
        train(args.out)
        return
    out = args.out or tempfile.mkdtemp(prefix="multi_worker_pack_")
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out]
    code = kg.run_local_workers(command, num_workers=args.workers, max_restarts=1)
    if code == 0:
        loaded = keras.saving.load_model(os.path.join(out, "pack.keras"))
        print(f"saved pack reloads: {len(loaded.members)} members, in {out}")
    sys.exit(code)


if __name__ == "__main__":
    main()
