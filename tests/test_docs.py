"""The commands in README.md and docs/: every option they give the project's own tools exists
(each tool's --help lists it), so a page cannot drift from the code it documents. The
set-up commands themselves are checked in test_readme.py."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOOL = re.compile(r"^(?:\S*/)?(?:tiering-bench|tiering-config|python)$")


def commands() -> list[tuple[str, tuple[str, ...], list[str]]]:
    """(page, the tool and its subcommand as argv words, the options given) of every call of
    a project tool in a ``sh`` block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```sh\n(.*?)\n```", page.read_text(), flags=re.S):
            variables: dict[str, str] = {}
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
                assignment = re.match(r'^(\w+)="(.*)"$', line)
                if assignment:
                    variables[assignment[1]] = assignment[2]
                    continue
                for name, value in variables.items():
                    line = line.replace(f"${name}", value)
                for command in re.split(r"&&|\|\||[;|&]", line):
                    try:
                        words = shlex.split(command.replace("[", "").replace("]", ""))
                    except ValueError:
                        continue
                    words = [w for w in words if "=" not in w or w.startswith("-")] if words else words
                    while words and re.match(r"^\w+=", words[0]):  # VAR=value before the command
                        words.pop(0)
                    if not words or not TOOL.match(words[0]):
                        continue
                    tool = Path(words[0]).name
                    if tool == "python":
                        if words[1:2] != ["-m"] or not words[2].startswith("tiering."):
                            continue
                        head = ("-m", words[2])
                        rest = words[3:]
                    else:
                        sub = words[1:2] if words[1:2] in (["serve"], ["overload"], ["check"]) else []
                        head, rest = (tool, *sub), words[1 + len(sub) :]
                    options = [w.split("=")[0] for w in rest if w.startswith("--")]
                    found.append((page.name, head, options))
    return found


def help_text(head: tuple[str, ...]) -> str:
    if head[0] == "-m":
        argv = [sys.executable, *head, "--help"]
    elif head[0] == "tiering-bench":
        argv = [sys.executable, "-c", "import sys; from tiering.benchmarks.loadgen import main; sys.exit(main())"]
        argv += [*head[1:], "--help"]
    else:
        argv = [sys.executable, "-m", "tiering.config_check", *head[1:], "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


CALLS = commands()


def test_the_pages_call_the_projects_tools():
    tools = {head for _, head, _ in CALLS}
    assert ("tiering-bench",) in tools and ("tiering-bench", "serve") in tools
    assert ("-m", "tiering.benchmarks.file_tier") in tools


@pytest.mark.parametrize("head", sorted({head for _, head, _ in CALLS}), ids=" ".join)
def test_every_option_the_pages_give_a_tool_is_one_it_takes(head):
    text = help_text(head)
    unknown = sorted(
        {(page, option) for page, h, options in CALLS if h == head for option in options if option not in text}
    )
    assert unknown == []


# What each tool the pages call needs installed first, beyond Python 3.11 and a clone: the
# expensive commands are run by hand (their numbers are the pages'); the cheap ones are also
# run as written by tests_bench/test_docs_numbers.py.
BENCH = "README's first set-up command: .venv with '.[bench]'"
NEEDS = {
    ("tiering-bench",): BENCH,
    ("tiering-bench", "overload"): BENCH,
    ("tiering-bench", "serve"): "README's third set-up command: .venv-vllm",
    ("tiering-config", "check"): "any install of the package",
    ("-m", "tiering.benchmarks.scheduler_cost"): BENCH,
    ("-m", "tiering.benchmarks.scale"): BENCH,
    ("-m", "tiering.benchmarks.file_tier"): BENCH,
    ("-m", "tiering.benchmarks.file_recovery"): BENCH,
    ("-m", "tiering.benchmarks.gpu_copy"): BENCH + " (on a GPU machine: a CUDA build of torch)",
    ("-m", "tiering.benchmarks.versus_vllm"): BENCH + " (it fetches the vllm==0.33.0 wheel with pip, no dependencies)",
    ("-m", "tiering.benchmarks.s3_tier"): "pip install -c constraints.txt -e '.[bench-s3]'",
    ("-m", "tiering.benchmarks.s3_outage"): "pip install -c constraints.txt -e '.[bench-s3]'",
    ("-m", "tiering.benchmarks.valkey_tier"): "pip install -c constraints.txt -e '.[bench-valkey]'",
    ("-m", "tiering.testing.valkey_server"): "pip install -c constraints.txt -e '.[bench-valkey]'",
    ("-m", "tiering.testing.mooncake_pool"): "pip install -c constraints.txt -e '.[bench-mooncake]'",
    ("-m", "tiering.benchmarks.mooncake_tier"): "pip install -c constraints.txt -e '.[bench-mooncake,bench-valkey]'",
    ("-m", "tiering.integrations.kv_events"): "README's third set-up command: .venv-vllm (vLLM's event types)",
    ("-m", "tiering.testing.s3_server"): "pip install -c constraints.txt -e '.[bench-s3]'",
}


def test_every_tool_the_pages_call_says_what_it_needs_installed():
    assert sorted({head for _, head, _ in CALLS} - NEEDS.keys()) == []  # a new tool on a page: say what it needs


def test_a_command_that_needs_an_extra_has_its_install_line_above_it_and_serve_runs_in_the_vllm_venv():
    missing = []
    for page in PAGES:
        for block in re.findall(r"```sh\n(.*?)\n```", page.read_text(), flags=re.S):
            lines = block.replace("\\\n", " ").splitlines()
            for number, line in enumerate(lines):
                for head, need in NEEDS.items():
                    called = " ".join(head)
                    if called not in line or line.lstrip().startswith(("pip", ".venv/bin/pip")):
                        continue
                    if need.startswith("pip install") and not any(need in above for above in lines[:number]):
                        missing.append((page.name, line[:80], need))
                    if head == ("tiering-bench", "serve") and ".venv-vllm/bin/tiering-bench" not in line:
                        missing.append((page.name, line[:80], need))
    assert missing == []


def test_every_block_that_calls_a_project_tool_is_an_sh_block_so_these_checks_see_it():
    untagged = []
    for page in PAGES:
        for language, block in re.findall(r"```(\w*)\n(.*?)\n```", page.read_text(), flags=re.S):
            first_words = {line.split()[0] for line in block.splitlines() if line.split()}
            if language != "sh" and any(TOOL.match(word) or word.startswith(".venv") for word in first_words):
                untagged.append((page.name, block.splitlines()[0][:60]))
    assert untagged == []


def test_no_page_points_a_user_at_a_path_outside_the_repository():
    """docs/results.md sent users to ``../shared/peer-bench``, which a clone does not have."""
    outside = [
        (page.name, number)
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        if re.search(r"\.\./shared|peer-bench", line)
    ]
    assert outside == []
