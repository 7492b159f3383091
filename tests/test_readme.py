"""The README is a user guide that stays true: its Python example runs as written, its links resolve, and the
commands it names exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_links_and_named_files_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links, "the README links its configuration reference and results"
    for link in links:
        assert (REPO / link).exists(), link
    for script in re.findall(r"bash (scripts/[\w.]+\.sh)", README):
        assert (REPO / script).is_file(), script
    results = REPO / "docs" / "results"
    for page in results.glob("*.md"):  # every result page says when, on what, with which code and command
        text = page.read_text()
        assert re.match(r"(report-)?\d{4}-\d{2}-\d{2}", page.name), page.name  # scripts/report.py: report-DATE.md
        assert "Machine" in text and "ommit" in text and "Command" in text, page.name


@pytest.mark.slow
def test_the_python_example_runs_as_written(capsys):
    [example] = [block for block in python_blocks(README) if "SpecDecoder" in block]
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"tau \d\.\d\d, \d+\.\d tokens/s", printed), printed[-500:]


@pytest.mark.slow
def test_the_server_example_runs_as_written_against_the_embedded_target(capsys):
    """The README's client code against `specdraft-serve` on the embedded default (on a free port, not 8000)."""
    from specdraft.decode.linear_kernels import candidates
    from tests.helpers import serving

    [example] = [block for block in python_blocks(README) if "base_url" in block]
    kernel = candidates(torch.float32, torch.device("cpu"))[0]  # what auto would pick is not this test's subject
    with serving("smollm2-135m-instruct", kernel=kernel, model_name="smollm2-135m-instruct") as (base, _):
        exec(compile(example.replace("http://127.0.0.1:8000", base), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert len(printed.split()) >= 3, printed
