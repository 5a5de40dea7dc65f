"""The live table of `keras-gpushare monitor`, one line per device and sample, like `dmon`."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from keras_gpushare.monitor.nvml import NvmlReader

_COLUMNS = (
    # header, unit, raw key suffix, width, decimals
    ("gpu", "key", None, 5, 0),
    ("nvml", "idx", None, 5, 0),
    ("sm", "%", "util", 6, 0),
    ("mem", "%", "mem_util", 6, 0),
    ("used", "MiB", "mem_used_mib", 9, 0),
    ("free", "MiB", "mem_free_mib", 9, 0),
    ("pwr", "W", "power_w", 8, 1),
    ("temp", "C", "temp_c", 6, 0),
    ("smact", "%", "sm_active", 6, 1),
)


class LiveTable:
    """Samples NVML on the calling thread and formats one line per device per sample.

    Args:
        interval: seconds between samples. Defaults to `1.0`.
        devices: `None` for the devices `CUDA_VISIBLE_DEVICES` shows (all when unset), or a
            list of NVML indices or UUIDs. Defaults to `None`.

    Example:

    ```python
    from keras_gpushare.monitor._table import LiveTable

    table = LiveTable(interval=0.5)
    problem = table.open()
    if problem is None:
        for line in table.lines(count=2):
            print(line)
    table.close()
    ```
    """

    def __init__(self, interval: float = 1.0, devices: list[int | str] | None = None) -> None:
        self.interval = float(interval)
        self.reader = NvmlReader(devices)

    def open(self) -> str | None:
        """Opens NVML; returns why there is nothing to show, or `None` when there is."""
        self.reader.open()
        return self.reader.unavailable

    def close(self) -> None:
        self.reader.close()

    def lines(self, count: int | None = None) -> Iterator[str]:
        """Yields the two header lines, then one line per device for `count` samples
        (forever with `None`). Ends early, with a last line saying why, when a GPU is lost."""
        yield "# " + " ".join(f"{h:>{w}}" for h, _, _, w, _ in _COLUMNS)[2:]
        yield "# " + " ".join(f"{u:>{w}}" for _, u, _, w, _ in _COLUMNS)[2:]
        n = 0
        next_at = time.monotonic()
        while count is None or n < count:
            figures = self.reader.read(processes=False)
            if self.reader.lost is not None:
                yield f"# {self.reader.lost}"
                return
            for device in self.reader.devices:
                yield self._row(device.key, device.nvml_index, figures)
            n += 1
            if count is not None and n >= count:
                return
            next_at += self.interval
            time.sleep(max(0.0, next_at - time.monotonic()))

    @staticmethod
    def _row(key: int, nvml_index: int | None, figures: dict[str, float]) -> str:
        cells: list[str] = []
        for _, _, suffix, width, decimals in _COLUMNS:
            if suffix is None:
                value: float | None = key if not cells else nvml_index
            else:
                value = figures.get(f"gpu{key}_{suffix}")
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append(f"{'-':>{width}}")
            else:
                cells.append(f"{value:>{width}.{decimals}f}")
        return " ".join(cells)
