"""`keras-gpushare autopack` and `keras-gpushare bench --plot`."""

import os

import pytest

from keras_gpushare import cli
from keras_gpushare._seeds_benchmark import plot

HERE = os.path.dirname(os.path.abspath(__file__))
BUILDERS = os.path.join(HERE, "autopack_builders.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_autopack_prints_progress_and_the_table(capsys, monkeypatch):
    monkeypatch.chdir(HERE)  # MODULE:BUILD_FN imports from the current folder
    status = cli.main(
        [
            "autopack",
            "autopack_builders:tiny_mlp",
            "--input-shape",
            "10",
            "--samples",
            "256",
            "--max-members",
            "2",
            "--time-budget",
            "60",
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "   1 members: " in out and "model-samples/s on the fused engine" in out
    assert "find_pack_size on CPU" in out
    assert "suggested pack size:" in out


def test_autopack_takes_a_file_path_and_classification_loss(capsys):
    status = cli.main(
        [
            "autopack",
            f"{BUILDERS}:classifier",
            "--input-shape",
            "4",
            "--samples",
            "128",
            "--loss",
            "sparse_categorical_crossentropy",
            "--max-members",
            "1",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "suggested pack size: 1 (the best measured: " in out
    assert out.rstrip().endswith("stopped: reached max_members=1)")


@pytest.mark.parametrize(
    "args, match",
    [
        (["no_such_module_xyz:build"], "module 'no_such_module_xyz' cannot be imported"),
        (["autopack_builders"], "Pass a module and a function separated by a colon"),
        (["autopack_builders:missing"], "has no function 'missing'. Functions it defines: "),
        (["autopack_builders:NOT_A_FUNCTION"], "has no function 'NOT_A_FUNCTION'"),
        (["nowhere/models.py:build"], "nowhere/models.py is not a file"),
        (["autopack_builders:tiny_mlp", "--input-shape", "ten"], "--input-shape: got 'ten'"),
        (["autopack_builders:tiny_mlp", "--input-shape", "0"], "--input-shape: got '0'"),
        (
            ["autopack_builders:tiny_mlp", "--input-shape", "12"],
            "takes inputs of shape 10. Pass --input-shape 10",
        ),
        (
            ["autopack_builders:tiny_mlp", "--input-shape", "10", "--samples", "64"]
            + ["--batch-size", "128"],
            "--batch-size: got 128 for --samples 64",
        ),
    ],
)
def test_autopack_bad_input_exits_non_zero_with_a_clear_message(args, match, capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    if "--input-shape" not in args:
        args = [*args, "--input-shape", "10"]
    assert cli.main(["autopack", *args]) != 0
    err = capsys.readouterr().err
    assert err.startswith("keras-gpushare autopack: error: ")
    assert match in err


def test_bench_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    status = cli.main(
        [
            "bench",
            "--members",
            "1,2",
            "--methods",
            "pack-fused",
            "--architecture",
            "same",
            "--samples",
            "256",
            "--epochs",
            "3",
            "--repeats",
            "1",
            "--plot",
            str(path),
        ]
    )
    assert status == 0
    assert f"plot: {path}" in capsys.readouterr().out
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_has_one_line_per_method(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        ("sequential", 1, {"steady_rate": 100.0}),
        ("pool(1)", 1, {"steady_rate": 90.0}),
        ("pack-fused", 1, {"steady_rate": 110.0}),
        ("sequential", 4, {"steady_rate": 100.0}),
        ("pool(2)", 4, {"steady_rate": 180.0}),
        ("pool(4)", 4, {"steady_rate": 250.0}),
        ("pack-fused", 4, {"steady_rate": 400.0}),
        ("pack-graph", 4, {"error": "RuntimeError: no"}),
    ]
    assert plot.series(results) == {
        "sequential": [(1, 100.0), (4, 100.0)],
        "pool(N)": [(1, 90.0), (4, 250.0)],
        "pack-fused": [(1, 110.0), (4, 400.0)],
        "pool(2)": [(4, 180.0)],
    }
    path = tmp_path / "lines.png"
    plot.plot_throughput(results, str(path))
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_bench_plot_errors_before_running(tmp_path, capsys, monkeypatch):
    assert cli.main(["bench", "--plot", str(tmp_path / "bench.jpg")]) != 0
    assert "Pass a file name ending in .png" in capsys.readouterr().err
    assert cli.main(["bench", "--plot", str(tmp_path / "no" / "bench.png")]) != 0
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.setattr(plot.importlib.util, "find_spec", lambda name: None)
    assert cli.main(["bench", "--plot", str(tmp_path / "bench.png")]) != 0
    assert "plotting needs matplotlib, which is not installed" in capsys.readouterr().err
