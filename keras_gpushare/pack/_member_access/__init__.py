"""`ModelPack`'s member backroom: the pack's per-member surface, mixed into `ModelPack` as
Keras mixes its trainer into `keras.Model`.

Its modules, read by `model.py` through `MemberAccess`:

- `_access`: reading and refreshing the member models, their weights, learning rates and
  status, and the slot operations (`load_member`, `reset_member`, `stop_member`).
- `_summary`: `summary()` and `count_params()` as the N separate models show them.

It never imports `model.py`, nor the compiling backroom (`_compiling`); it may read the loop
backroom (`_loop`).
"""

from keras_gpushare.pack._member_access._access import MemberAccess

__all__ = ["MemberAccess"]
