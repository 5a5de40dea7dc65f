"""Prints the "behaves like fit" table of the conformance matrix as Markdown.

    python tests/conformance/matrix_table.py > table.md

Each cell is what the suite asserts for that feature, engine and backend: `✓` (every
aspect equals the members trained alone), `✗ N` (the run fails: issue 12 item N), `◐ N`
(some aspects differ, named after it), `—` (not run there). It reads the cases and the
known failures, so it stays true as long as the suite passes (its xfails are strict).
"""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conformance_cases import CASES, case_aspects, known_failure, skip_reason  # noqa: E402

COLUMNS = [
    ("graph", "tensorflow", "graph (TF)"),
    ("fused", "tensorflow", "fused (TF)"),
    ("widths", "tensorflow", "widths (TF)"),
    ("fused", "jax", "fused (JAX)"),
    ("widths", "jax", "widths (JAX)"),
    ("fused", "torch", "fused (torch)"),
]

FEATURES = {
    "basic": "validation_data, CSVLogger, TensorBoard, ModelCheckpoint, evaluate, predict",
    "sample_weight": "sample_weight, weighted_metrics, validation sample weights",
    "class_weight_validation_split": "class_weight, validation_split",
    "tf_data": "tf.data datasets (train and validation)",
    "schedule_early_stopping": "LearningRateSchedule per member, EarlyStopping (restore best)",
    "backup_and_restore": "BackupAndRestore after an interruption",
    "lr_scheduler": "LearningRateScheduler (item 1)",
    "reduce_lr_on_plateau": "ReduceLROnPlateau (item 1)",
    "fit_twice_save_load": "fit twice, save, load_model, fit again",
    "sparse_from_logits": "sparse labels, from_logits loss",
    "subclassed": "subclassed members",
    "dict_inputs": "multi-input members (dict inputs)",
    "shard": 'data="shard" (member i trains on x[i::N])',
    "outputs_list": "two list outputs, y=[y_out0, y_out1] (item 2)",
    "outputs_per_member": "two list outputs, one label list per member (item 2)",
    "outputs_dict": "two dict outputs, y={name: ...}, metrics dict (item 2)",
    "mixed_float16": "mixed_float16 policy (item 3)",
    "compiled_members": "members compiled beforehand, pack.compile(loss=...) (item 8)",
    "member_early_stopping": "MemberEarlyStopping(val_loss) vs EarlyStopping per member",
    "member_early_stopping_r2": "MemberEarlyStopping(val_r2_score) direction (item 10)",
    "batch_callbacks": "per-batch hooks, ModelCheckpoint(save_freq=5) (item 9)",
    "optimizer_ema": "optimizer use_ema=True",
    "optimizer_families": "Adam for one member, SGD for another (item 4)",
    "steps_per_epoch": "steps_per_epoch, validation_steps below the data's batches (24.1)",
    "generator_steps_per_epoch": "an endless Python generator with steps_per_epoch (24.1)",
    "py_dataset_workers": "keras.utils.PyDataset with workers=2 (24.2)",
}


def _tag(reason: str) -> str:
    if reason.startswith("issue 12 item "):
        return reason.split(":")[0].removeprefix("issue 12 item ")
    return "c"  # found by this suite, outside items 1-11


def cell(case, engine: str, backend: str) -> str:
    if engine not in case.engines or skip_reason(case, engine, backend):
        return "—"
    aspects = case_aspects(case)
    failing = {a: known_failure(case.name, engine, a, backend) for a in aspects}
    failing = {a: r for a, r in failing.items() if r}
    if not failing:
        return "✓"
    tags = ", ".join(sorted({_tag(r) for r in failing.values()}))
    if len(failing) == len(aspects):
        return f"✗ {tags}"
    return f"◐ {tags} ({', '.join(failing)})"


def table() -> str:
    lines = [
        "| feature | case | " + " | ".join(title for _, _, title in COLUMNS) + " |",
        "| --- | --- |" + " --- |" * len(COLUMNS),
    ]
    for case in CASES.values():
        cells = [cell(case, engine, backend) for engine, backend, _ in COLUMNS]
        feature = FEATURES.get(case.name) or f"`{case.name.removeprefix('optimizer_')}` (item 4)"
        lines.append(f"| {feature} | `{case.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
