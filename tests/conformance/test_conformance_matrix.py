"""The matrix: every case x engine, each aspect compared with the members trained alone.

One training run per (case, engine) serves every aspect (see conformance_harness.py); an
aspect that differs today is a strict xfail naming the issue-12 item (conformance_cases.py).
"""

import csv

import keras
import pytest
from conformance_cases import CASES, case_aspects, in_make_test, known_failure, skip_reason
from conformance_harness import (
    assert_callback_calls,
    assert_evaluate_dict,
    assert_evaluate_list,
    assert_figures,
    assert_history,
    assert_predict,
    assert_weights,
    close,
    files_in,
)


def cells(aspect):
    """`(case, engine)` parameters of every case compared on `aspect`, marked."""
    params = []
    for case in CASES.values():
        if aspect not in case_aspects(case):
            continue
        for engine in case.engines:
            marks = []
            skip = skip_reason(case, engine)
            if skip:
                marks.append(pytest.mark.skip(reason=skip))
            if not in_make_test(case, engine):
                marks.append(pytest.mark.slow)
            reason = known_failure(case.name, engine, aspect)
            if reason:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            params.append(pytest.param(case.name, engine, id=f"{case.name}-{engine}", marks=marks))
    return params


@pytest.mark.parametrize("case,engine", cells("weights"))
def test_weights(runner, case, engine):
    assert_weights(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("fused"))
def test_trains_fused(runner, case, engine):
    run = runner.run(CASES[case], engine)
    assert run.pack.engine == "fused", f"{run.label}: {run.pack.fusion_report}"


@pytest.mark.parametrize("case,engine", cells("history"))
def test_history(runner, case, engine):
    assert_history(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("callbacks"))
def test_callback_calls(runner, case, engine):
    assert_callback_calls(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("evaluate_dict"))
def test_evaluate_dict(runner, case, engine):
    assert_evaluate_dict(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("evaluate_list"))
def test_evaluate_list(runner, case, engine):
    assert_evaluate_list(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("predict"))
def test_predict(runner, case, engine):
    assert_predict(runner.run(CASES[case], engine))


@pytest.mark.parametrize("case,engine", cells("csv"))
def test_csv_logger(runner, case, engine):
    run = runner.run(CASES[case], engine)
    pack_rows = _rows(run.pack_side.folder / "log.csv")
    for i, twin in enumerate(run.twins):
        twin_rows = _rows(twin.folder / "log.csv")
        assert len(pack_rows) == len(twin_rows), run.label
        for pack_row, twin_row in zip(pack_rows, twin_rows):
            assert_figures(pack_row, twin_row, i, run, "CSVLogger row")


def _rows(path):
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.parametrize("case,engine", cells("tensorboard"))
def test_tensorboard(runner, case, engine):
    run = runner.run(CASES[case], engine)
    for split in ("train", "validation"):
        pack_scalars = _scalars(run.pack_side.folder / "tb" / split)
        for i, twin in enumerate(run.twins):
            twin_scalars = _scalars(twin.folder / "tb" / split)
            assert set(pack_scalars) >= {0}, run.label
            assert sorted(pack_scalars) == sorted(twin_scalars), f"{run.label}: {split} steps"
            for step, figures in twin_scalars.items():
                assert_figures(
                    pack_scalars[step], figures, i, run, f"TensorBoard {split} step {step}"
                )


def _scalars(folder):
    """`{step: {key: value}}` of a TensorBoard run folder's `epoch_<key>` scalars."""
    import tensorflow as tf

    found = {}
    for path in sorted(folder.glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if not value.tag.startswith("epoch_"):
                    continue
                number = (
                    tf.make_ndarray(value.tensor)
                    if value.HasField("tensor")
                    else value.simple_value
                )
                found.setdefault(event.step, {})[value.tag[len("epoch_") :]] = float(number)
    return found


@pytest.mark.parametrize("case,engine", cells("checkpoint"))
def test_model_checkpoint(runner, case, engine):
    run = runner.run(CASES[case], engine)
    pack_files = files_in(run.pack_side.folder / "ckpt")
    for i, twin in enumerate(run.twins):
        assert pack_files == files_in(twin.folder / "ckpt"), run.label
        for name in pack_files:
            pack = keras.models.load_model(run.pack_side.folder / "ckpt" / name)
            alone = keras.models.load_model(twin.folder / "ckpt" / name)
            for k, (a, b) in enumerate(zip(pack.members[i].get_weights(), alone.get_weights())):
                close(a, b, run, f"{name}: member {i} weight {k}")


@pytest.mark.parametrize("case,engine", cells("backup"))
def test_backup_files(runner, case, engine):
    """The interrupted fit leaves the same backup files; the finished one removes them.

    That the resumed fit restored the member's weights, step and epoch is what the
    weights and history aspects of this case check.
    """
    run = runner.run(CASES[case], engine)
    listing = (run.pack_side.folder / "backup_files.txt").read_text()
    assert listing, f"{run.label}: the interrupted fit left no backup"
    for twin in run.twins:
        assert listing == (twin.folder / "backup_files.txt").read_text(), run.label
        left = (twin.folder / "backup").exists()
        assert (run.pack_side.folder / "backup").exists() == left, run.label


@pytest.mark.parametrize("case,engine", cells("batches"))
def test_batch_hooks(runner, case, engine):
    """`on_train_batch_end` fires once per batch, with the same batch index, as alone."""
    run = runner.run(CASES[case], engine)
    batches = (run.pack_side.folder / "batches.txt").read_text()
    for twin in run.twins:
        assert batches == (twin.folder / "batches.txt").read_text(), run.label


@pytest.mark.parametrize("case,engine", cells("batch_checkpoints"))
def test_integer_save_freq_checkpoints(runner, case, engine):
    """`ModelCheckpoint(save_freq=5)` writes a file at the same epochs and batches."""
    run = runner.run(CASES[case], engine)
    names = files_in(run.pack_side.folder / "batch_ckpt")
    for twin in run.twins:
        assert names == files_in(twin.folder / "batch_ckpt"), run.label
