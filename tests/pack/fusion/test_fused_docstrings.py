"""The Example sections of the sequence layers' fused forms run and print what they say."""

import contextlib
import io
import re

import pytest

from keras_gpushare.pack.fusion.layers_attention import FusedMultiHeadAttention
from keras_gpushare.pack.fusion.layers_conv import FusedConvTranspose
from keras_gpushare.pack.fusion.layers_core import FusedRandomPerSample
from keras_gpushare.pack.fusion.layers_recurrent import FusedGRU, FusedLSTM, FusedSimpleRNN
from keras_gpushare.pack.fusion.layers_wrappers import FusedBidirectional, FusedTimeDistributed

CLASSES = (
    FusedLSTM,
    FusedGRU,
    FusedSimpleRNN,
    FusedBidirectional,
    FusedTimeDistributed,
    FusedMultiHeadAttention,
    FusedConvTranspose,
    FusedRandomPerSample,
)


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_docstring_example_prints_its_comments(cls):
    code = re.search(r"```python\n(.*?)```", cls.__doc__, re.S).group(1)
    code = "\n".join(line[4:] for line in code.splitlines())
    expected = [c.strip() for c in re.findall(r"print\(.*\)\s*# (.*)$", code, re.M)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, cls.__name__, "exec"), {})
    assert printed.getvalue().split("\n")[: len(expected)] == expected
