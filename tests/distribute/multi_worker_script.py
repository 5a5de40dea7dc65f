"""One worker of the multi-worker tests (run by `kg.run_local_workers`, never by pytest).

Trains a 3-member pack under `MultiWorkerMirroredStrategy` and leaves in `--out`: its
progress (`progress-w{task}-a{attempt}.json`, with its pid, after every batch), its
members' final weights and state (`result-w{task}.npz` / `.json`) and the pack saved by
`pack.save` on every worker (only the chief's file may appear).
"""

import argparse
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

import keras_gpushare as kg


def _write_json(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


class Progress(keras.callbacks.Callback):
    def __init__(self, path, pause):
        super().__init__()
        self.path = path
        self.pause = pause
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        _write_json(self.path, {"pid": os.getpid(), "epoch": self.epoch, "batch": batch})
        time.sleep(self.pause)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engine", choices=["fused", "graph"], default="fused")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backup")
    parser.add_argument("--min-delta", type=float, help="MemberEarlyStopping's min_delta")
    parser.add_argument("--pause", type=float, default=0.0)
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
    callbacks = [Progress(os.path.join(args.out, f"progress-w{task}-a{attempt}.json"), args.pause)]
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
