"""The base class of fused layers: one layer holding N members' copies of a layer."""

import contextlib
import contextvars
from collections.abc import Iterator

import keras
import numpy as np
from keras import ops

from keras_gpushare.pack._backend import BACKEND
from keras_gpushare.pack.fusion import layout as layout_lib
from keras_gpushare.pack.fusion import settings as settings_lib

# Set while the converter builds fused layers whose every weight it then overwrites with the
# members' values: their initializers would only cost time (on JAX, one XLA compile of a
# random draw per stacked shape), so the weights start as zeros made on the host.
_MEMBERS_LOADED_AFTER = contextvars.ContextVar("members_loaded_after", default=False)


@contextlib.contextmanager
def members_loaded_after() -> Iterator[None]:
    """Fused layers built inside skip their weights' initializers (the caller loads them)."""
    token = _MEMBERS_LOADED_AFTER.set(True)
    try:
        yield
    finally:
        _MEMBERS_LOADED_AFTER.reset(token)


def host_zeros(shape, dtype=None):
    """An initializer: zeros made with NumPy and handed over as they are (on JAX by a
    transfer), which no backend compiles a program for."""
    try:
        zeros = np.zeros(shape, dtype=np.dtype(keras.backend.standardize_dtype(dtype)))
    except TypeError:
        zeros = np.zeros(shape, dtype="float32")
    return BACKEND.host_to_device(zeros)


def host_constant(values):
    """An initializer of per-member `values` (a sequence, one per row), made as `host_zeros`
    is: no backend compiles a program for it."""

    def initializer(shape, dtype=None):
        dtype = np.dtype(keras.backend.standardize_dtype(dtype or "float32"))
        return BACKEND.host_to_device(np.reshape(np.asarray(values, dtype=dtype), shape))

    return initializer


@keras.saving.register_keras_serializable(package="keras_gpushare")
class FusedLayer(keras.layers.Layer):
    """Base class of a layer that computes N members' copies of one layer at once.

    A fused layer holds the weights of N structurally identical layers stacked on a
    leading member axis, so a member kernel of shape `(in, out)` becomes a fused kernel
    of shape `(N, in, out)`. Its inputs and outputs carry the member axis too: a tensor
    that is `(B, ...)` for one member is `(N, B, ...)` in the fused model ("stacked").
    An input may also arrive "replicated", still `(B, ...)` and shared by all members,
    which is how a fused model avoids copying a batch N times before its first layer.

    The protocol a fused form of a custom layer follows (see `register_fused_layer`):

    - `__init__(n_members, member_config, input_stacked=True, **kwargs)`: keep this
      signature; `member_config` is `layer.get_config()` of member 0's layer, and
      `input_stacked` says, for each flattened input, whether it is stacked. Extra
      keyword arguments go to `keras.layers.Layer`.
    - `build(input_shape)`: create the weights with `add_weight`, each of shape
      `(n_members, *member_weight_shape)`, in the same order and with the same
      trainability as the member layer's `weights`. The converter checks the shapes
      and copies member i's weights into slice i.
    - `call(inputs, training=None)`: start with `inputs = self.to_stacked(inputs)` (or
      handle replicated inputs more cheaply) and return stacked outputs.
    - `unsupported_reason(member_config)` (class method, optional): return a sentence
      saying why a configuration cannot be fused, or `None` when it can.
    - `per_member_keys` (class attribute, optional): config keys whose values may differ
      between members (a dropout rate, say). The converter then lets them differ and
      passes every member's value in `member_config["per_member"][key]`, a list of N.
    - `regularizer_keys` (class attribute, optional): the config keys of the weight
      regularizers (`kernel_regularizer`, ...), whose strengths may differ between
      members (a member without one has strength 0). They arrive in
      `member_config["per_member"]` too; pass `regularizer(self.member_config, key)` from
      `_checks` to `add_weight`. The pack adds each member's own penalty, computed on its
      own part of the stacked weight, to that member's loss.
    - `member_state` (class attribute, optional): names of non-trainable weights that a
      training call updates (BatchNormalization's moving statistics). A member that is not
      training (stopped early, frozen) keeps its slice of them unchanged, as its own
      `fit` would have ended.
    - `handles_masks` (class attribute, optional): set it to `True` when the fused form
      computes what the member layer does with Keras masks (`Embedding(mask_zero=True)`,
      `Masking`): it uses an incoming mask as the member does and `compute_mask` returns
      the member's output mask in the fused layout (stacked when the output is stacked).
      Members whose layer uses or makes a mask do not fuse otherwise.
    - `slot_keys` (class attribute, optional): config keys (a width, an activation, a
      rate) that the layer can hold as per-member variables instead of constants of the
      compiled step. A layer given `settings.HELD` (`settings=` of `__init__` and
      `from_member`, kept as `self.settings`) does so, and then takes a new member in
      place: `slot_problem(layer)` says why `layer` does not fit the slot (a width over
      the fused layer's, an activation it does not compute), and `load_member(j, layer)`
      writes `layer`'s weights and settings into slot `j`.
    - `xla_pays_on_cpu` (class attribute, optional): set it to `False` when XLA's CPU
      backend computes the layer no faster than TensorFlow's own kernels (convolutions,
      pooling), so compiling a step holding it only costs time: `jit_compile="auto"` then
      leaves XLA off for its group on a TensorFlow CPU.
    - Other call arguments: the converter calls the fused layer as the member layer was
      called, with the first argument positional and the others by name, so `call` takes
      the member's argument names (`initial_state`, `key`, `attention_mask`, ...). Only the
      first argument may arrive replicated; every other tensor argument is stacked.

    Members of different sizes (padded fusion, see `layout`). A fused form that can take
    them says so; any other fuses only members whose sizes agree:

    - `size_keys` (class attribute): config keys whose values may differ, such as `units`:
      the fused layer is as wide as the widest member and each member owns a corner of it
      (the rest is padding, kept at zero). Their values arrive in
      `member_config["per_member"]` as `per_member_keys` do (`None` for a member that skips
      the layer).
    - `member_config["input_layouts"]`: for each flattened first-argument input, the layout
      (`layout.to_config`) of its features, or `None` when no member pads it.
    - `output_layouts(layers, input_layouts, input_shapes)` (class method): each output's
      layout, or a
      reason the padded inputs cannot be taken. The default passes a layer through only
      unpadded inputs; `passes_layout = True` declares a layer whose output features are its
      input's, position for position (activations, dropout, pooling, normalization).
    - `member_weight_index(k, i)`: where member `i`'s own weight lies in fused weight `k`:
      `(position in the member layer's weights or None, index tuple or None)`.
    - `skippable` (class attribute): a member may leave the layer out (a shallower member
      of a depth search) when it keeps its input's shape; the converter then passes that
      member's input through unchanged.
    - `computes_present_only` (class attribute): when members leave the layer out, it
      computes only the members that have it, unless the others' product is cheaper than
      slicing it out (`cost.computes_every_member`); the cost model counts the same.

    Args:
        n_members: Number of members N fused in this layer.
        member_config: The config of the member layer (from `get_config()`); member 0's
            name and initializers are kept but not used.
        input_stacked: Whether each input is stacked `(N, B, ...)` (`True`) or replicated
            `(B, ...)` (`False`); one bool for all inputs or a list with one bool per
            flattened input. Defaults to `True`.
        **kwargs: Base layer keyword arguments (`name`, `trainable`, `dtype`).

    Example:

    ```python
    import keras
    from keras_gpushare.pack.fusion import FusedLayer

    class FusedScale(FusedLayer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(self.n_members, 1), initializer="ones")

        def call(self, inputs, training=None):
            x = self.to_stacked(inputs)
            return x * keras.ops.reshape(self.scale, (self.n_members, 1, 1))

    layer = FusedScale(n_members=3, member_config={})
    print(layer(keras.ops.ones((2, 4))).shape)  # (3, 2, 4)
    ```
    """

    per_member_keys: tuple[str, ...] = ()
    size_keys: tuple[str, ...] = ()
    regularizer_keys: tuple[str, ...] = ()
    passes_layout = False
    skippable = False
    computes_present_only = False
    handles_masks = False
    member_state: tuple[str, ...] = ()
    slot_keys: tuple[str, ...] = ()
    xla_pays_on_cpu = True

    def __init__(self, n_members, member_config, input_stacked=True, settings=None, **kwargs):
        super().__init__(**kwargs)
        self.n_members = int(n_members)
        self.member_config = dict(member_config)
        self.input_stacked = input_stacked
        if settings is None:
            settings = settings_lib.named(self.member_config.get("settings"))
        # How this layer holds its `slot_keys` settings (`settings.CONSTANTS` or `HELD`).
        self.settings = settings if settings.holds(type(self)) else settings_lib.CONSTANTS
        if self.settings.held:
            self.member_config["settings"] = self.settings.name

    def add_slot_variable(self, name, values, dtype):
        """A `(n_members,)` variable holding one setting per member (`slot_keys`)."""
        values = np.asarray(values, dtype=dtype)
        return keras.layers.Layer.add_weight(
            self,
            shape=values.shape,
            initializer=lambda shape, dtype=None: values,
            dtype=dtype,
            trainable=False,
            name=name,
        )

    def slot_problem(self, layer):
        """Why `layer` cannot be loaded into a slot of this layer, or `None` when it can."""
        return None

    def load_member(self, j, layer):
        """Writes `layer`'s weights and `slot_keys` settings into slot `j`."""
        raise NotImplementedError(f"`{type(self).__name__}` takes no member in place.")

    def clear_member(self, j):
        """Slot `j` leaves this layer out (a model of another depth was loaded): its part of
        the layer's weights and settings may be cleared. Defaults to leaving them."""

    def add_weight(self, shape=None, initializer=None, *args, **kwargs):
        """`keras.layers.Layer.add_weight`; host zeros when the converter loads members after."""
        if _MEMBERS_LOADED_AFTER.get():
            initializer = host_zeros
        return super().add_weight(shape, initializer, *args, **kwargs)

    @classmethod
    def member_keys(cls):
        """The config keys whose values may differ between the members of a fused layer."""
        return (*cls.per_member_keys, *cls.size_keys, *cls.regularizer_keys)

    @classmethod
    def unsupported_reason(cls, member_config):
        """Say why `member_config` cannot be fused, or return `None` when it can."""
        return None

    def stacked_flags(self, inputs):
        """Return one bool per flattened input: whether that input is stacked."""
        count = len(keras.tree.flatten(inputs))
        if isinstance(self.input_stacked, (list, tuple)):
            return [bool(flag) for flag in self.input_stacked]
        return [bool(self.input_stacked)] * count

    @classmethod
    def output_layouts(cls, layers, input_layouts, input_shapes):
        """Each flattened output's layout (`None`: unpadded), and why not (or `None`).

        Args:
            layers: every member's layer (`None` for a member that skips it).
            input_layouts: for each flattened first-argument input, its layout or `None`.
            input_shapes: those inputs' shapes in the first member that has the layer.

        Returns:
            `(layouts, reason)`: a list with one layout per output, or `None` and a sentence.
        """
        padded = [lay for lay in input_layouts if not layout_lib.is_full(lay)]
        if not padded:
            return [None], None
        if cls.passes_layout:
            return [input_layouts[0]], None
        return None, f"`{cls.__name__}` cannot take members' inputs of different sizes"

    @classmethod
    def from_member(
        cls,
        layer,
        n_members,
        input_stacked,
        member_layers=(),
        input_layouts=None,
        capacity=None,
        settings=None,
    ):
        """Create the fused form of `layer` (a member's) for `n_members` members.

        `member_layers` (every member's layer, `None` where a member skips it) supplies
        the `per_member_keys` and `size_keys` values; `input_layouts` the padding of the
        inputs; `capacity` (only for classes declaring `template_capacity`, built for
        slots) what the layer holds beyond its members (`_capacity.template_capacity`);
        `settings` (only for classes declaring `slot_keys`) how the layer holds them
        (`settings.HELD`; defaults to constants). Override when the fused class needs more
        than `layer.get_config()`.
        """
        config = layer.get_config()
        keys = cls.member_keys()
        if keys and member_layers:
            configs = [None if m is None else m.get_config() for m in member_layers]
            config["per_member"] = {k: [None if c is None else c[k] for c in configs] for k in keys}
        if input_layouts is not None and not all(layout_lib.is_full(x) for x in input_layouts):
            config["input_layouts"] = [layout_lib.to_config(x) for x in input_layouts]
        if capacity:
            config["slot_capacity"] = dict(capacity)
        return cls(
            n_members=n_members,
            member_config=config,
            input_stacked=input_stacked,
            name=layer.name,
            trainable=layer.trainable,
            dtype=layer.dtype_policy,
            settings=settings,
        )

    def per_member(self, key):
        """Each member's value of config `key` (`None` for a member that skips the layer)."""
        values = self.member_config.get("per_member", {}).get(key)
        return list(values) if values is not None else [self.member_config[key]] * self.n_members

    def input_layout(self, index=0):
        """The layout of the `index`-th flattened input, or `None` when it is unpadded."""
        layouts = self.member_config.get("input_layouts")
        return None if not layouts else layout_lib.from_config(layouts[index])

    def member_weight_index(self, k, i):
        """Where member `i`'s own weight lies in fused weight `k`: `(position, index)`.

        `position` is the weight's place in the member layer's `weights` (`None` when the
        member has no such weight); `index` selects its part of slice `i` (`None`: all).
        """
        return k, None

    def activate(self, y, key="activation"):
        """`y` through each member's own activation (config `key`).

        Members that share an activation are computed together; different activations
        (relu for some members, tanh for others) are selected member by member.
        """
        specs = self.per_member(key)
        present = [spec for spec in specs if spec is not None] or [None]
        specs = [present[0] if spec is None else spec for spec in specs]
        names = [repr(spec) for spec in specs]
        if len(set(names)) == 1:
            return keras.activations.get(specs[0])(y)
        # The last activation everywhere, the others selected over it: one select (and its
        # gradient's two) per activation but one, each a pass over the activations.
        *others, last = dict.fromkeys(names)
        result = keras.activations.get(specs[names.index(last)])(y)
        for name in others:
            members = np.asarray([n == name for n in names])
            spec = specs[names.index(name)]
            keep = self.member_broadcast(ops.convert_to_tensor(members), len(y.shape))
            result = ops.where(keep, keras.activations.get(spec)(y), result)
        return result

    def input_is_stacked(self, index=0):
        """Whether the `index`-th flattened input is stacked."""
        if isinstance(self.input_stacked, (list, tuple)):
            return bool(self.input_stacked[index])
        return bool(self.input_stacked)

    @property
    def output_stacked(self):
        """Whether the outputs are stacked; fused layers with weights always stack."""
        return True

    def stack(self, x):
        """Broadcast a replicated `(B, ...)` tensor to a stacked `(N, B, ...)` one."""
        x = ops.expand_dims(x, 0)
        return ops.repeat(x, self.n_members, axis=0)

    def to_stacked(self, inputs):
        """Return `inputs` with every replicated leaf broadcast to the member axis."""
        flat = keras.tree.flatten(inputs)
        flags = self.stacked_flags(inputs)
        flat = [x if stacked else self.stack(x) for x, stacked in zip(flat, flags)]
        return keras.tree.pack_sequence_as(inputs, flat)

    def stacked_mask(self, mask, stacked=None):
        """A mask in the stacked layout: replicated masks broadcast to the member axis.

        Args:
            mask: A mask (or structure of masks, `None` leaves allowed) belonging to an
                input whose layout `stacked` gives. Defaults to none (required).
            stacked: Whether that input is stacked; `None` reads the first input's flag.
                Defaults to `None`.
        """
        stacked = self.input_is_stacked() if stacked is None else stacked
        if stacked:
            return mask
        return keras.tree.map_structure(lambda m: None if m is None else self.stack(m), mask)

    def member_broadcast(self, value, rank):
        """Reshape a `(N, *s)` weight to broadcast against a rank-`rank` stacked tensor.

        The member axis stays first, the weight's own axes go last, and ones fill the
        axes between (the batch axis and any others).
        """
        value = ops.convert_to_tensor(value)
        tail = tuple(value.shape[1:])
        ones = (1,) * (rank - 1 - len(tail))
        return ops.reshape(value, (self.n_members, *ones, *tail))

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "n_members": self.n_members,
                "member_config": self.member_config,
                "input_stacked": self.input_stacked,
            }
        )
        return config


def fold(x):
    """Merge the member and batch axes: `(N, B, ...)` becomes `(N * B, ...)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (-1, *shape[2:]))


def unfold(x, n_members):
    """Split the leading axis back: `(N * B, ...)` becomes `(N, B, ...)`."""
    shape = ops.shape(x)
    return ops.reshape(x, (n_members, -1, *shape[1:]))
