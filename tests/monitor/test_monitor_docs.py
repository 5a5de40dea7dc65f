"""The examples in docs/monitoring.md that run as written run, on a CPU, with NVML faked."""

import pathlib
import textwrap

from fake_nvml import h100s

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "monitoring.md"


def section_code(title):
    """The first python block of the section `## {title}`."""
    section = DOCS.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return textwrap.dedent(section.split("```python\n", 1)[1].split("```", 1)[0])


def test_docs_several_workers_example_runs(fake_nvml, capsys, monkeypatch):
    fake_nvml(h100s(1))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    code = section_code("Several workers")
    exec(compile(code, "<docs/monitoring.md: Several workers>", "exec"), {})
    assert capsys.readouterr().out.strip().splitlines()[-1] == "None ['cpu_util', 'gpu0_util']"
