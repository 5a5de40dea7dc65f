"""Small models for the autopack tests (importable as `autopack_builders` by the CLI tests)."""

import keras


def tiny_mlp(i=0):
    """A 10-16-1 MLP; member `i` gets its own seed."""
    keras.utils.set_random_seed(i)
    return keras.Sequential(
        [
            keras.Input((10,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def classifier():
    """A 4-input, 3-class softmax model built without an index."""
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


NOT_A_FUNCTION = 3
