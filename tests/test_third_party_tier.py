"""The third-party tier guide (docs/writing-a-tier.md), verbatim, out of tree: its three files are copied into
an empty directory, installed with the built kv-tiering wheel into a fresh venv, and their
tests run there, from a directory holding its own `backends` and `benchmarks` packages (as an
application may), against the installed engine only."""

import re
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^ *`dictstore/([\w.]+)`:\n *```\w+\n(.*?)\n *```", re.S | re.M)


def guide_files() -> dict[str, str]:
    """File name -> content of each file the guide shows."""
    guide = (ROOT / "docs" / "writing-a-tier.md").read_text()
    return {name: textwrap.dedent(body) + "\n" for name, body in BLOCK.findall(guide)}


def run(*command, cwd=None) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh venv with the kv-tiering wheel and the guide's package installed (no
    editable install, no repository on the path); the test environment's own packages
    stand in for the dependencies an index would provide."""
    work = tmp_path_factory.mktemp("out-of-tree")
    source = work / "kv-tiering"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "build", "*.egg-info"))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", work, source)
    env = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", env)
    python = env / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(purelib, "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (wheel,) = work.glob("kv_tiering-*.whl")
    install = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps"]
    run(*install, wheel)
    package = work / "dictstore"
    package.mkdir()
    for name, content in guide_files().items():
        (package / name).write_text(content)
    run(*install, "--no-build-isolation", package)
    return env


def test_the_guide_shows_a_store_its_packaging_and_its_tests():
    assert sorted(guide_files()) == ["dictstore_tier.py", "pyproject.toml", "test_dictstore.py"]


def test_the_wheel_installs_nothing_but_tiering_at_the_top_level(venv):
    top_level = run(venv / "bin" / "python", "-c", TOP_LEVEL).stdout.split()
    assert top_level == ["tiering"]


TOP_LEVEL = "import importlib.metadata as m; print(*m.distribution('kv-tiering').read_text('top_level.txt').split())"


def test_the_guide_passes_both_suites_out_of_tree_beside_an_apps_own_backends(venv, tmp_path):
    app = tmp_path / "app"
    for package in ("backends", "benchmarks"):  # an application's own packages of these names
        (app / package).mkdir(parents=True)
        (app / package / "__init__.py").write_text(f"raise ImportError('the engine imported the app's {package}')\n")
    shutil.copy(venv.parent / "dictstore" / "test_dictstore.py", app)
    done = run(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_dictstore.py", cwd=app)
    passed = re.search(r"\b(\d+) passed\b", done.stdout)
    assert passed and int(passed.group(1)) >= 20 and " failed" not in done.stdout, done.stdout
    found = run(venv / "bin" / "python", "-c", WHERE, cwd=app).stdout.split()
    assert found[0].startswith(str(venv)) and "dictstore" in found[1:]


WHERE = (
    "import tiering.backends.file as f; from tiering import SecondaryTierFactory as F; "
    "print(f.__file__, *F.supported_types())"
)
