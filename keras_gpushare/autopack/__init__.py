"""Autopack: `find_pack_size`, how many models to train at once on this machine.

`search` decides which pack sizes to try and which to suggest, `measure` trains one pack
and measures it, `result` holds what is reported, `cli` serves `keras-gpushare autopack`.
"""

from keras_gpushare.autopack.result import PackSizeMeasurement, PackSizeResult
from keras_gpushare.autopack.search import find_pack_size

__all__ = ["PackSizeMeasurement", "PackSizeResult", "find_pack_size"]
