"""What a pack writes into a `.keras` file and rebuilds from it.

The config holds the members' own configs and the plan's groups, so a loaded pack rebuilds
exactly the saved layout (its weights are stored in that layout). Files written by
keras-gpushare 0.1 (one engine for all members, compile arguments as one list each) still
load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from keras_gpushare.pack._compiling import _compile_args
from keras_gpushare.pack.engines.base import Engine, GradientEngine


def check_saveable(pack_name: str, engines: Sequence[Engine]) -> None:
    """Raises when members were loaded by values into slots, which their configs no
    longer describe.

    Args:
        pack_name: the pack's name.
        engines: the pack's engines.
    """
    loaded = [i for e in engines for i in e.loaded_by_values()]
    if loaded:
        raise ValueError(
            f"ModelPack {pack_name} cannot be saved whole: members {sorted(loaded)} were "
            "loaded by values into slots their fused layers were built for, which the "
            "members' configs no longer describe. Save each member with "
            "`pack.member(i).save(...)`, or the weights with `pack.save_weights(...)`."
        )


def pack_config(
    name: str,
    members: Sequence[keras.Model],
    options: dict[str, Any],
    engine: str,
    gradient_engines: Sequence[GradientEngine],
) -> dict:
    """The pack's config (`get_config`).

    Args:
        name: the pack's name.
        members: the pack's members.
        options: the pack's `data`, `fuse`, `on_nan` and `_slot_values`.
        engine: `pack.engine`.
        gradient_engines: the engines whose groups the config records.
    """
    return {
        "name": name,
        "members": [keras.saving.serialize_keras_object(m) for m in members],
        "data": options["data"],
        "fuse": options["fuse"],
        "on_nan": options["on_nan"],
        "engine": engine,
        "groups": [list(engine.member_ids) for engine in gradient_engines],
        "_slot_values": options["_slot_values"],
    }


def init_arguments(config: dict) -> dict:
    """The arguments of `ModelPack(...)` that rebuild the pack `config` describes.

    Args:
        config: a pack's config, from this version or from keras-gpushare 0.1.
    """
    config = dict(config)
    config["members"] = [keras.saving.deserialize_keras_object(m) for m in config["members"]]
    engine = config.pop("engine", None)
    if "groups" not in config:
        # Written by keras-gpushare 0.1: one engine for all members.
        n = len(config["members"])
        config["groups"] = [list(range(n))] if engine == "fused" else []
    return config


def compile_arguments(members: Sequence[keras.Model], config: dict) -> dict:
    """The arguments of the pack's `_compile_members` from a saved compile config.

    Args:
        members: the pack's members.
        config: the deserialized compile config, from this version or from
            keras-gpushare 0.1 (one list per argument).
    """
    if "members" in config:
        return config
    return {
        **config,
        "members": _compile_args.member_args(
            members,
            config["optimizer"],
            config["loss"],
            config["loss_weights"],
            config["metrics"],
            config["weighted_metrics"],
            config["run_eagerly"],
            config["auto_scale_loss"],
        ),
    }
