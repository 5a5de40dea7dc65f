"""`PackInternals`: what the pack's own helpers read of the `ModelPack` they serve.

The callbacks a pack adds to `fit` (`_watcher`, `_member_callbacks`) and its TensorFlow
steps (`_tf_steps`) are modules that `pack/model.py` imports, so they cannot name
`ModelPack`, not even for types (import-linter's no-cycle contract counts type-only
imports). They name this protocol instead. `ModelPack` follows it by hand: mypy cannot tell
(a class with untyped Keras bases passes for any protocol), so keep the two in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import keras

if TYPE_CHECKING:
    from keras_gpushare.pack.engines.base import SteppingEngine


class PackInternals(Protocol):
    """The members, status and per-member access of a `ModelPack`, for its helpers."""

    _members: Sequence[keras.Model]
    _status: keras.Variable
    _member_compile_args: dict[str, Any] | None
    optimizer: Any

    @property
    def status(self) -> list[str]: ...

    @property
    def _stepping_engines(self) -> list[SteppingEngine]: ...

    def stop_member(self, index: int) -> None: ...

    def refresh_members(self, optimizer_state: bool = True) -> list[keras.Model]: ...

    def member_model(self, index: int) -> keras.Model: ...

    def member_optimizer(self, index: int) -> Any: ...

    def get_member_weights(self, index: int) -> list[Any]: ...

    def set_member_weights(self, index: int, weights: list[Any]) -> None: ...
