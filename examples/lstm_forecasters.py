"""One LSTM forecaster per store, trained together as one fused pack, each stopping on its own.

Twelve stores' daily sales (synthetic: level, weekly season, trend, promotions, noise).
Every member reads the last 24 days of all stores (sales of the others are covariates) and
forecasts its own store's next day: the pack gets one label array per member. The members
share an architecture, so the pack fuses them: one recurrent loop for all twelve LSTMs, one
batched matmul per step. `MemberEarlyStopping` stops each forecaster when its own
validation loss stops improving and gives it back its best weights.

    python examples/lstm_forecasters.py
"""

import os

import keras
import numpy as np

import keras_gpushare as kg

QUICK = os.environ.get("KERAS_GPUSHARE_QUICK") == "1"  # the test suite's short run
STORES, WINDOW = 12, 24


def sales(days: int, rng: np.random.Generator) -> np.ndarray:
    """`(days, STORES)` standardized daily sales."""
    t = np.arange(days)[:, None]
    level = rng.uniform(50, 150, size=STORES)
    weekly = rng.uniform(5, 25, size=STORES) * np.sin(
        2 * np.pi * (t + rng.integers(7, size=STORES)) / 7
    )
    trend = rng.normal(0, 0.03, size=STORES) * t
    promotions = (rng.random((days, STORES)) < 0.05) * rng.uniform(10, 40, size=STORES)
    series = level + weekly + trend + promotions + rng.normal(0, 4, size=(days, STORES))
    return ((series - series.mean(0)) / series.std(0)).astype("float32")


def windows(series: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Inputs `(samples, WINDOW, STORES)` and one next-day target array per store."""
    starts = range(len(series) - WINDOW)
    x = np.stack([series[s : s + WINDOW] for s in starts])
    y = series[WINDOW:]
    return x, [y[:, [store]] for store in range(STORES)]


def forecaster(store: int) -> keras.Model:
    keras.utils.set_random_seed(store)
    return keras.Sequential(
        [
            keras.Input((WINDOW, STORES)),
            keras.layers.LSTM(16),
            keras.layers.Dense(1),
        ],
        name=f"store_{store}",
    )


def main() -> None:
    days, epochs = (120, 1) if QUICK else (1200, 60)
    series = sales(days, np.random.default_rng(7))
    split = int(0.8 * days)
    x_train, y_train = windows(series[:split])
    x_val, y_val = windows(series[split - WINDOW :])

    pack = kg.ModelPack([forecaster(s) for s in range(STORES)])
    print(f"engine: {pack.engine}")
    pack.compile(optimizer=[keras.optimizers.Adam(3e-3) for _ in range(STORES)], loss="mse")
    stop = kg.callbacks.MemberEarlyStopping(
        monitor="val_loss", patience=5, restore_best_weights=True
    )
    pack.fit(
        x_train,
        y_train,
        validation_data=(x_val, y_val),
        batch_size=32,
        epochs=epochs,
        callbacks=[stop],
        verbose=0,
    )
    predictions = pack.predict(x_val, verbose=0)
    print(f"{'store':>5} {'stopped at':>10} {'val MAE':>8} {'last-value MAE':>15}")
    for store in range(STORES):
        mae = np.abs(predictions[store] - y_val[store]).mean()
        naive = np.abs(x_val[:, -1, [store]] - y_val[store]).mean()
        stopped = stop.stopped_epoch[store]
        when = "-" if stopped is None else str(stopped + 1)
        print(f"{store:>5} {when:>10} {mae:>8.3f} {naive:>15.3f}")
    print("status:", ", ".join(pack.status))


if __name__ == "__main__":
    main()
