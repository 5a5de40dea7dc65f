"""A trial's callbacks that write one fixed file write it alone.

KerasTuner runs one trial at a time, so a `CSVLogger` passed to `search` writes its file for
one trial after another: the file ends as the last trial's log (or, with `append=True`, every
trial's rows one trial after another). Trials that train at once would each hold the same
path open and interleave their rows. So each trial execution's copy writes a file of its own
beside the path (`.<name>.trial-<id>-<execution>.part`), and when the execution ends its file
takes the path's place (`os.replace`), or, with `append=True`, its rows are added to the path
after those already there (its header only if the path has none). The path thus holds what
plain KerasTuner leaves, whole trials only, the trial that ended last standing for the one
run last.
"""

from __future__ import annotations

import dataclasses
import os

import keras


@dataclasses.dataclass(frozen=True)
class OwnFile:
    """A callback's file redirected to `part` until its trial ends; `path` is the user's."""

    part: str
    path: str
    append: bool

    def settle(self) -> None:
        """Puts what the trial wrote in the user's path, and removes `part`."""
        if not os.path.exists(self.part):
            return
        if not self.append or not _has_rows(self.path):
            os.replace(self.part, self.path)
            return
        with open(self.part, encoding="utf-8") as part:
            lines = part.readlines()[1:]  # the part's header: the path has one already
        with open(self.path, "a", encoding="utf-8") as path:
            path.writelines(lines)
        os.remove(self.part)


def discard(files: list[OwnFile]) -> None:
    """Removes what `files` wrote so far (their trial runs again elsewhere)."""
    for own_file in files:
        if os.path.exists(own_file.part):
            os.remove(own_file.part)


def redirect(callbacks: list, trial_id: str, execution: int) -> list[OwnFile]:
    """Points each `CSVLogger` among `callbacks` (a trial execution's own copies) at a file
    of its own; the files to settle when the execution ends."""
    files = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.CSVLogger):
            path = os.fspath(callback.filename)
            folder, name = os.path.split(path)
            part = os.path.join(folder, f".{name}.trial-{trial_id}-{execution}.part")
            callback.filename = part
            files.append(OwnFile(part, path, bool(callback.append)))
    return files


def _has_rows(path: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0
