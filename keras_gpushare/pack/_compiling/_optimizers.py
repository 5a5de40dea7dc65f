"""The pack-level optimizer of the graph engine: a container of the members' optimizers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_gpushare import _upstream


class MemberOptimizers(keras.optimizers.Optimizer):
    """Holds one optimizer per member; the pack applies each to its own member.

    Keras reads `model.optimizer` for the step count (`iterations`, one per pack step) and,
    like TensorBoard does, looks for an `optimizers` attribute to report each member's
    learning rate as `learning_rate_<optimizer name>`.
    """

    def __init__(self, optimizers: Sequence[keras.optimizers.Optimizer], **kwargs: Any) -> None:
        kwargs.setdefault("name", "member_optimizers")
        super().__init__(learning_rate=0.0, **kwargs)
        self.optimizers = list(optimizers)

    def build(self, var_list: Sequence) -> None:
        super().build([])

    def finalize_variable_values(self, var_list: Any) -> None:
        """Lets each member's optimizer finalize its member's weights, as Keras's `fit` does
        at its end (an optimizer with `use_ema=True` swaps in the moving averages)."""
        for optimizer in self.optimizers:
            if optimizer.built:
                optimizer.finalize_variable_values(_upstream.optimizer_variables_list(optimizer))

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        raise NotImplementedError(
            "MemberOptimizers is applied member by member by the ModelPack; call "
            "`pack.members[i].optimizer.apply(...)` to update one member."
        )

    def get_config(self) -> dict:
        config = super().get_config()
        config["optimizers"] = [keras.saving.serialize_keras_object(o) for o in self.optimizers]
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> MemberOptimizers:
        config = dict(config)
        optimizers = [keras.saving.deserialize_keras_object(o) for o in config.pop("optimizers")]
        config.pop("learning_rate", None)
        return cls(optimizers, name=config.get("name", "member_optimizers"))
