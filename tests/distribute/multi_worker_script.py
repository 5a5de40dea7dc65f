"""One worker of the multi-worker tests (run by `kg.run_local_workers`, never by pytest).

Trains a 3-member pack under `MultiWorkerMirroredStrategy` and leaves in `--out` its
members' final weights and state (`result-w{task}.npz` / `.json`) and the pack saved by
`pack.save` on every worker (only the chief's file may appear). With `--kill-at WORKER EPOCH
BATCH`, that worker of the first attempt kills itself (SIGKILL) at the end of that batch,
after writing `killed-w{task}.json` (the epoch and batch).
"""

import argparse
import json
import os
import signal

import keras
import numpy as np
import tensorflow as tf

import keras_gpushare as kg


def _write_json(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


class KillAt(keras.callbacks.Callback):
    """Kills this process with SIGKILL at the end of batch `batch` of epoch `epoch`, after
    writing them to `path`."""

    def __init__(self, path, epoch, batch):
        super().__init__()
        self.path = path
        self.kill_epoch = epoch
        self.kill_batch = batch
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch):
            _write_json(self.path, {"epoch": self.epoch, "batch": batch})
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=["fused", "graph"], default="fused")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backup")
    parser.add_argument("--min-delta", type=float, help="MemberEarlyStopping's min_delta")
    parser.add_argument(
        "--kill-at",
        type=int,
        nargs=3,
        metavar=("WORKER", "EPOCH", "BATCH"),
        help="the worker of the first attempt that kills itself, and when",
    )
    args = parser.parse_args()

    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    attempt = int(os.environ.get("KERAS_GPUSHARE_ATTEMPT", "0"))
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    widths = [8, 8, 8] if args.engine == "fused" else [4, 8, 12]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 10)).astype("float32")
    y = (x[:, :3].sum(axis=1, keepdims=True) > 0).astype("float32")
    with strategy.scope():
        members = []
        for i, width in enumerate(widths):
            keras.utils.set_random_seed(i)
            members.append(
                keras.Sequential(
                    [
                        keras.Input((10,)),
                        keras.layers.Dense(width, activation="relu"),
                        keras.layers.Dense(1, activation="sigmoid"),
                    ]
                )
            )
        pack = kg.ModelPack(members, fuse=args.engine == "fused")
        pack.compile(
            optimizer=[keras.optimizers.Adam(r) for r in (0.01, 0.003, 0.3)],
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    callbacks = []
    if args.kill_at is not None and args.kill_at[0] == task and attempt == 0:
        callbacks.append(KillAt(os.path.join(args.out, f"killed-w{task}.json"), *args.kill_at[1:]))
    if args.backup:
        callbacks.append(keras.callbacks.BackupAndRestore(args.backup))
    if args.min_delta is not None:
        callbacks.append(
            kg.callbacks.MemberEarlyStopping(
                monitor="val_loss", patience=0, min_delta=args.min_delta
            )
        )
    history = pack.fit(
        x,
        y,
        batch_size=16,
        epochs=args.epochs,
        shuffle=False,
        validation_data=(x[:32], y[:32]),
        callbacks=callbacks,
        verbose=0,
    )
    pack.save(os.path.join(args.out, f"pack-w{task}.keras"))
    pack.save(os.path.join(args.out, "pack.keras"))
    weights = {
        f"m{i}_{k}": w for i, m in enumerate(pack.members) for k, w in enumerate(m.get_weights())
    }
    weights["predictions"] = pack.predict(x[:40], batch_size=16, stack=True, verbose=0)
    np.savez(os.path.join(args.out, f"result-w{task}.npz"), **weights)
    _write_json(
        os.path.join(args.out, f"result-w{task}.json"),
        {
            "status": pack.status,
            "steps": [
                int(keras.ops.convert_to_numpy(m.optimizer.iterations)) for m in pack.members
            ],
            "epochs": history.epoch,
            "attempt": attempt,
            "engine": pack.engine,
            "val_losses": {k: v for k, v in history.history.items() if k.startswith("val_m")},
        },
    )


if __name__ == "__main__":
    main()
