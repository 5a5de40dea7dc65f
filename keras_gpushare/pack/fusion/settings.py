"""How fused layers and the vectorized optimizer hold their members' settings.

A member's settings are what may differ between the members of a fused layer or of the
vectorized optimizer: a `Dense` layer's width, activation and bias, a dropout rate, which
calls a member leaves out, its optimizer's family, hyperparameters and weight decay. A pack
holds them one of two ways, chosen once when it is made and handed to every fused layer
and to its optimizer, as optax's `inject_hyperparams` keeps one update for both:

- `CONSTANTS`: constants of the compiled step (a plain `ModelPack`). The step is traced for
  these members and no other.
- `HELD`: values held as data, per-member variables of the compiled step, so that a slot
  takes another model of other settings (`load_member`) without a new compile (the
  tuner's programs). A layer then holds what later models may need (its template's
  capacity: the widest width, every activation), and every call a member may leave out has
  a `FusedSkip`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keras_gpushare.pack.fusion import _transforms


class Settings:
    """One way of holding the members' settings (`CONSTANTS` or `HELD`).

    Attributes:
        held: whether the settings are variables of the step (`HELD`).
        name: the way's name in a fused layer's config (`"constants"` or `"held"`).
    """

    held = False
    name = "constants"
    # What `VectorizedOptimizer.load_member` takes of a new optimizer beyond its rate.
    loaded_optimizer_fields: tuple[str, ...] = ()

    def holds(self, layer_class: type) -> bool:
        """Whether a fused layer of `layer_class` holds its `slot_keys` settings as data."""
        return False

    def optimizer_runs(self, rules: Sequence[Any], families: Sequence[Any]) -> list:
        """A group's runs of the vectorized optimizer, `[(rule, a, b)]`: members `a:b`
        updated by `rule`. Constants: the stretches of members sharing a rule.

        Args:
            rules: the group's members' rules, in slice order.
            families: those rules, each once.
        """
        return _transforms.runs(rules)

    def run_slot_names(self, rule: Any, hypers: Sequence[dict], built_with: set) -> list:
        """The optimizer slots a run of `rule` holds. Constants: those its members' own
        hyperparameters `hypers` need.

        Args:
            rule: the run's rule.
            hypers: the run's members' hyperparameters.
            built_with: the slots the group's members of that family were built with.
        """
        return list(rule.slots(hypers))

    def __repr__(self) -> str:
        return f"settings.{self.name.upper()}"


class _Held(Settings):
    held = True
    name = "held"
    loaded_optimizer_fields = ("rule", "hyper", "weight_decay")

    def holds(self, layer_class: type) -> bool:
        return bool(getattr(layer_class, "slot_keys", ()))

    def optimizer_runs(self, rules: Sequence[Any], families: Sequence[Any]) -> list:
        # Every family over the whole group: a slot may take a member of any of them.
        return [(rule, 0, len(rules)) for rule in families]

    def run_slot_names(self, rule: Any, hypers: Sequence[dict], built_with: set) -> list:
        return sorted(built_with)


CONSTANTS = Settings()
HELD = _Held()


def named(name: Any) -> Settings:
    """The `Settings` `name` gives: `"held"` or `"constants"` (a config's `name`), `None` for
    constants, or a `Settings` itself."""
    if isinstance(name, Settings):
        return name
    if name == HELD.name:
        return HELD
    if name is None or name == CONSTANTS.name:
        return CONSTANTS
    raise ValueError(
        f'Invalid value for argument `settings`: got {name!r}. Expected "constants" or "held".'
    )
