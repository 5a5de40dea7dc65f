"""What a search compiled and computed: its programs (packs), and the share of their FLOPs
that trained no trial (padding to a program's widest trial, idle or stopped slots)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

from keras_gpushare.pack import ModelPack
from keras_gpushare.pack.program import own_flops, program_flops


class SearchLedger:
    """The programs a search compiled, the trials loaded into freed slots or trained alone,
    and the FLOPs its programs computed against those its trials needed, epoch by epoch
    (estimates of the planner's cost model, the same for every sample of an epoch)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets what an earlier search recorded."""
        self.programs = 0
        self.probes = 0
        self.probe_seconds = 0.0
        self.loaded = 0
        self.alone = 0
        self.computed = 0.0
        self.needed = 0.0
        self.estimated = True
        self._own: dict[str, float | None] = {}
        self._packs: dict[int, float | None] = {}

    def trial(self, trial_id: str, model: keras.Model) -> None:
        """Notes the FLOPs of the model trial `trial_id` built."""
        if trial_id not in self._own:
            self._own[trial_id] = own_flops(model)

    def probed(self, builds: int, seconds: float) -> None:
        """`builds` probe builds of the hypermodel took `seconds` (`_space_plan`)."""
        self.probes += builds
        self.probe_seconds += seconds

    def compiled(self, pack: ModelPack, members: list) -> None:
        """A program (or a round's pack) was built for `members` and compiled."""
        self.programs += 1
        self._packs[id(pack)] = program_flops(pack, members)

    def epoch(self, pack: ModelPack, trial_ids: Iterable[str]) -> None:
        """`pack` trains one epoch, its slots holding the executions of `trial_ids`."""
        computed = self._packs.get(id(pack))
        needed = [self._own.get(trial_id) for trial_id in trial_ids]
        if computed is None or None in needed:
            self.estimated = False
            return
        self.computed += computed
        self.needed += sum(n for n in needed if n is not None)

    def summary(self) -> str | None:
        """One line for the search's log, or None when no program was compiled."""
        if not self.programs:
            return None
        line = (
            f"Search: {_count(len(self._own), 'trial')} built, "
            f"{_count(self.programs, 'program')} compiled"
        )
        if self.probes:
            line += (
                f" (planned from {_count(self.probes, 'probe build')} of the space, "
                f"{self.probe_seconds:.1f} s)"
            )
        if self.loaded:
            line += f", {_count(self.loaded, 'trial execution')} loaded into freed slots"
        if self.alone:
            line += f", {_count(self.alone, 'trial')} trained alone"
        if self.estimated and self.computed > 0:
            waste = 1.0 - self.needed / self.computed
            line += (
                f"; {waste:.0%} of the FLOPs the programs computed trained no trial "
                "(padding to a program's widest trial, free or stopped slots)"
            )
        else:
            line += "; padding not estimated (a model that does not fuse)"
        return line + "."


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class EpochCounter(keras.callbacks.Callback):
    """Records each epoch of `pack` in `ledger`; `trial_ids()` gives the trials its slots
    hold as the epoch begins."""

    def __init__(self, ledger: SearchLedger, pack: ModelPack, trial_ids: Any) -> None:
        super().__init__()
        self.ledger = ledger
        self.pack = pack
        self.trial_ids = trial_ids

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.ledger.epoch(self.pack, self.trial_ids())
