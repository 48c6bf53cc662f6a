"""The README's three set-up commands stay true: CI runs each of them verbatim."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)
    return [block for block in blocks if block.startswith("python3.11 -m venv")]


def test_readme_has_exactly_three_setup_commands_and_ci_runs_them():
    main, tests, with_vllm = setup_commands()
    assert main.endswith("tiering-bench --verify")
    assert tests.endswith("-m pytest")
    assert with_vllm.endswith("-m pytest tests_vllm")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert [line for line in ci if line.startswith("python3.11 -m venv")] == [main, tests, with_vllm]


def test_importing_the_engine_imports_no_serving_engine():
    code = "import sys, tiering, tiering.integrations; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_quickstart_example_runs_the_whole_walkthrough():
    script = ROOT / "examples" / "quickstart.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "evicted from the primary tier to make room: A B" in done.stdout
    assert "promoted back: load A B" in done.stdout
    assert done.stdout.rstrip().endswith("removed: True")


def test_usage_example_runs():
    (example,) = re.findall(r"^```python\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    exec(compile(example, "README.md", "exec"), {})


def test_the_project_is_installed_from_the_repository_or_its_wheel_never_by_a_name_no_index_has():
    """kv-tiering is not on PyPI: ``pip install 'kv-tiering[vllm]'`` failed for a new user."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    by_name = [(page.name, line) for page in pages for line in page.read_text().splitlines() if "'kv-tiering[" in line]
    assert by_name == []
    import tiering

    readme = (ROOT / "README.md").read_text()
    wheels = re.findall(r"dist/(kv_tiering-\S+?\.whl)", readme)
    assert wheels and set(wheels) == {f"kv_tiering-{tiering.__version__}-py3-none-any.whl"}  # what pip wheel builds
