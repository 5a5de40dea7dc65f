"""Which fused layer class computes which Keras layer class."""

import logging

import keras

from keras_gpushare.pack.fusion.base import FusedLayer

logger = logging.getLogger(__name__)

_FUSED_FORMS: dict[type, type[FusedLayer]] = {}


def register_fused_layer(layer_class):
    """Register a fused form for a layer class, for use as a class decorator.

    The fused class subclasses `FusedLayer` and follows its protocol: weights of shape
    `(n_members, *member_shape)` created in `build` in the order of the member layer's
    `weights`, and a `call` that takes and returns member-stacked tensors. Registration
    is by exact class: a subclass of a registered layer needs its own fused form. The
    fused class is also registered with Keras's serialization (package
    `"keras_gpushare_fused"`) unless it already is, so fused models holding it can be
    saved to `.keras` files.

    Args:
        layer_class: The Keras layer class (not an instance) whose fused form follows.

    Returns:
        A decorator taking the fused class and returning it unchanged.

    Example:

    ```python
    import keras
    from keras import ops
    import keras_gpushare as kg
    from keras_gpushare.pack.fusion import FusedLayer

    class Scale(keras.layers.Layer):
        def build(self, input_shape):
            self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

        def call(self, x):
            return x * self.scale

    @kg.register_fused_layer(Scale)
    class FusedScale(FusedLayer):
        def build(self, input_shape):
            self.scale = self.add_weight(
                shape=(self.n_members, input_shape[-1]), initializer="ones"
            )

        def call(self, inputs, training=None):
            x = self.to_stacked(inputs)
            return x * self.member_broadcast(self.scale, len(x.shape))
    ```
    """
    if not isinstance(layer_class, type) or not issubclass(layer_class, keras.layers.Layer):
        raise TypeError(
            "Invalid value for argument `layer_class`: expected a subclass of "
            f"`keras.layers.Layer`, got {layer_class!r}. Pass the layer class itself, "
            "e.g. `@register_fused_layer(MyLayer)`."
        )

    def decorator(fused_class):
        if not isinstance(fused_class, type) or not issubclass(fused_class, FusedLayer):
            raise TypeError(
                f"Invalid fused form for `{layer_class.__name__}`: expected a subclass of "
                f"`keras_gpushare.pack.fusion.FusedLayer`, got {fused_class!r}. Derive the "
                "fused class from `FusedLayer` and follow its protocol."
            )
        if (
            keras.saving.get_registered_object(keras.saving.get_registered_name(fused_class))
            is not fused_class
        ):
            keras.saving.register_keras_serializable(package="keras_gpushare_fused")(fused_class)
        previous = _FUSED_FORMS.get(layer_class)
        if previous is not None and previous is not fused_class:
            logger.info(
                "Replacing fused form %s of %s with %s.",
                previous.__name__,
                layer_class.__name__,
                fused_class.__name__,
            )
        _FUSED_FORMS[layer_class] = fused_class
        return fused_class

    return decorator


def fused_form(layer_class):
    """Return the fused class registered for `layer_class`, or `None`."""
    return _FUSED_FORMS.get(layer_class)
