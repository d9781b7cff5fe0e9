"""The wheel a user installs: built here offline (`pip wheel --no-deps --no-build-isolation`, from a copy
of the files the build reads), then its metadata and its files read as a package index would."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from helpers import REPO

pytest.importorskip("setuptools")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = source / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = out.glob("fp8train-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def test_the_wheel_holds_the_package_and_nothing_else(wheel) -> None:
    names = set(wheel.namelist())
    sources = {
        "fp8train/" + p.relative_to(REPO / "src" / "fp8train").as_posix()
        for p in (REPO / "src" / "fp8train").rglob("*.py")
    }
    assert len(sources) > 80 and "fp8train/amax/state.py" in sources
    assert sources - names == set(), "missing from the wheel"
    outside = {n for n in names if not n.startswith("fp8train/") and ".dist-info/" not in n}
    assert outside == set(), "the wheel installs more than the fp8train package"
    assert not [n for n in names if "test" in n.split("/")[-1] or n.startswith("tests/")]
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "fp8train = fp8train.tools.cli:main" in wheel.read(entry_points).decode()


def test_the_torch_bound_is_the_supported_range(wheel) -> None:
    """README and design.md (section 12) say 2.7 to 2.13; the tested torch lies inside the bound."""
    requires = _metadata(wheel).get_all("Requires-Dist")
    (dep,) = [r for r in requires if r.startswith("torch") and "extra ==" not in r]
    assert set(dep[len("torch") :].split(",")) == {">=2.7", "<2.14"}, dep
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert (2, 7) <= major_minor < (2, 14)
    for doc in ("README.md", "docs/design.md"):
        assert "2.7 to 2.13" in (REPO / doc).read_text(encoding="utf-8"), doc


def test_project_urls_lead_to_the_docs_the_examples_and_the_issues(wheel) -> None:
    urls = dict(u.split(", ", 1) for u in _metadata(wheel).get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Examples", "Issues"}
    home = urls["Homepage"]
    assert re.fullmatch(r"https://github\.com/[\w-]+/[\w-]+", home), home
    assert all(u.startswith(home + "/") for name, u in urls.items() if name != "Homepage"), urls
    assert urls["Documentation"].endswith("/docs/guide.md") and urls["Examples"].endswith("/examples")
    for name in ("Documentation", "Examples"):  # the paths they name exist in the repository
        assert (REPO / urls[name].split("/main/", 1)[1]).exists(), urls[name]


def test_the_package_page_has_no_relative_link(wheel) -> None:
    """A package index shows the README without the repository: every link and image is absolute,
    into the repository Homepage names, and each file it names exists."""
    metadata = _metadata(wheel)
    assert metadata["Description-Content-Type"] == "text/markdown"
    readme = metadata.get_payload()
    home = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL"))["Homepage"]
    targets = re.findall(r"\]\(([^)\s]+)\)", readme) + re.findall(r'src="([^"]+)"', readme)
    assert len(targets) > 5 and any(t.endswith(".png") for t in targets)
    relative = [t for t in targets if not re.match(r"https?://", t)]
    assert relative == [], "relative links break on a package page"
    raw = home.replace("https://github.com/", "https://raw.githubusercontent.com/")
    for target in targets:
        path = target.split("#")[0]
        for prefix in (home + "/blob/main/", home + "/tree/main/", raw + "/main/"):
            if path.startswith(prefix):
                assert (REPO / path[len(prefix) :]).exists(), target
                break
        else:
            assert path == home or path.startswith(home + "/") or "github.com/fp8train" not in path, target
