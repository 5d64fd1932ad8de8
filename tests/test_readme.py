"""Every command README.md gives runs, cheaply, so the README cannot drift from the code.

The commands are read from the README itself (its ```bash blocks, and `make ...` / `python -m ...`
code spans in the prose), so a command added to the README is checked without editing this file.
A `make` command runs as `make -n` with the README's variables and ARGS (its target must exist and
every variable it sets must be one the Makefile reads); every stage it would start
(`python -m <stage>`, `torchrun ... -m <stage>`), and every stage the README starts directly, is
checked the way `--cfg job` would: its Hydra config (the stage's `@stage_main("<config>")`) is
composed with the README's overrides and its interpolations resolved, so a misspelt key, a missing
config group option or a bad interpolation fails here. Nothing that needs a model, a GPU or hours
runs. Also: the README stays short, no Markdown file skips a heading level, and the README links
every doc.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from importlib.util import find_spec
from pathlib import Path

import hydra
import pytest
from omegaconf import OmegaConf

import dspark.config  # noqa: F401  (registers the resolvers the configs use, e.g. dspark.target_name)
from dspark.entry import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAKEFILE = REPO / "Makefile"
MAX_README_LINES = 250
FENCE = re.compile(r"^```[^\n]*\n.*?^```[ \t]*$", re.S | re.M)
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


class CommandRefused(AssertionError):
    """A README command that names something the project does not have."""


def readme_commands(text: str) -> list[str]:
    """The command lines of a README: each line of its ```bash blocks, and `make ...`/`python -m ...` spans."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    prose = FENCE.sub("", text)
    commands += [span for span in re.findall(r"`([^`\n]+)`", prose) if re.match(r"(make|python -m) [a-z]", span)]
    return list(dict.fromkeys(commands))


def split_command(line: str) -> tuple[dict[str, str], list[str]]:
    """Leading `VAR=value` assignments and the words of the command, as the shell splits them."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, value = ASSIGNMENT.match(words[0]).groups()
        env[name] = value
        words = words[1:]
    return env, words


def stage_config(module: str) -> str | None:
    """The Hydra config of `python -m <module>` (its `@stage_main("...")`); None for a module that is no stage."""
    base = REPO.joinpath(*module.split("."))
    for source in (base.with_suffix(".py"), base / "__main__.py"):
        if source.is_file():
            found = re.search(r"@stage_main\(\s*\"([^\"]+)\"", source.read_text())
            return found.group(1) if found else None
    if (REPO / module.split(".")[0]).is_dir() or find_spec(module) is None:
        raise CommandRefused(f"python -m {module}: no such module in the repository or the environment")
    return None


def check_stage(module: str, overrides: list[str]) -> None:
    """Compose the stage's config with the overrides and resolve it, as `python -m <module> ... --cfg job --resolve`."""
    config_name = stage_config(module)
    if config_name is None:
        return
    try:
        with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = hydra.compose(config_name=config_name, overrides=overrides)
        OmegaConf.resolve(cfg)
    except Exception as err:  # Hydra's and OmegaConf's errors share no base class
        raise CommandRefused(f"python -m {module} {shlex.join(overrides)}: {type(err).__name__}: {err}") from err


def makefile_variables() -> set[str]:
    """The variables the Makefile reads (`$(NAME)`) or sets (`NAME ?=`)."""
    text = MAKEFILE.read_text()
    return set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text)) | set(
        re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*[?:]?=", text, re.M)
    )


def stages_in_recipe(recipe: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `... -m <module> args` line that `make -n` printed; the last `-m` names
    the stage (`python -m train.launch ... -m train args`: the launcher starts the stage)."""
    stages = []
    for line in recipe.replace("\\\n", " ").splitlines():
        _, words = split_command(line)
        if "-m" in words[:-1] and Path(words[0]).name.startswith(("python", "torchrun")):
            at = len(words) - 1 - words[::-1].index("-m")
            stages.append((words[at + 1], words[at + 2 :]))
    return stages


def check_make(env: dict[str, str], args: list[str]) -> None:
    """`make -n` with the command's targets and variables; then every stage its recipe would start."""
    known = makefile_variables()
    unknown = [a.split("=", 1)[0] for a in args if "=" in a and a.split("=", 1)[0] not in known]
    if unknown:
        raise CommandRefused(f"make {shlex.join(args)}: the Makefile reads no variable {', '.join(unknown)}")
    run_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")} | env
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *args], cwd=REPO, env=run_env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise CommandRefused(f"make -n {shlex.join(args)}: {done.stderr.strip()}")
    for module, overrides in stages_in_recipe(done.stdout):
        check_stage(module, overrides)


def check_command(line: str) -> None:
    """Run one README command as cheaply as it can be checked; CommandRefused if it could not work."""
    env, words = split_command(line)
    if words and words[0] == "make":
        check_make(env, words[1:])
    elif len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1] == "-m":
        check_stage(words[2], words[3:])
    else:
        raise CommandRefused(f"{line}: no way to check this command (a make target or python -m <stage>)")


COMMANDS = readme_commands(README.read_text())


def test_readme_has_commands():
    first = [shlex.split(command, comments=True) for command in COMMANDS[:2]]
    assert first == [["make", "demo"], ["make", "test"]], "the README opens with make demo and make test"
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS, ids=[c[:80] for c in COMMANDS])
def test_readme_command(command):
    check_command(command)


@pytest.mark.parametrize(
    "command",
    [
        "make no-such-target",
        "make train GPUZ=2",
        'make train ARGS="train.no_such_key=1"',
        'make data ARGS="data=no-such-source"',
        'make eval ARGS="+experiment=no-such-experiment"',
        "python -m train loss.weights.kl=${no_such.key}",
        "python -m no_such_stage key=1",
        "python -m eval.no_such_stage drafter=x",
        "vllm serve x",
    ],
)
def test_a_command_that_cannot_work_is_refused(command):
    with pytest.raises(CommandRefused):
        check_command(command)


def test_the_published_recipe_is_checked_through_make():
    """The stage behind a make target is composed with the README's ARGS (here: the quoted loss dict)."""
    recipe = subprocess.run(
        ["make", "-n", "train", "GPUS=2", "ARGS=+experiment=qwen3-0.6b 'loss.weights={ce: 0.1, kl: 0}'"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert stages_in_recipe(recipe) == [("train", ["+experiment=qwen3-0.6b", "loss.weights={ce: 0.1, kl: 0}"])]


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; details belong in docs/"


def heading_levels(text: str) -> list[int]:
    return [len(m.group(1)) for m in re.finditer(r"^(#{1,6}) ", FENCE.sub("", text), re.M)]


MARKDOWN = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "dev").glob("*.md"))]


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(REPO)) for p in MARKDOWN])
def test_no_heading_level_is_skipped(path):
    levels = heading_levels(path.read_text())
    assert levels and levels[0] == 1, f"{path.name} starts with a level-1 heading"
    skips = [(a, b) for a, b in zip(levels, levels[1:]) if b > a + 1]
    assert not skips, f"{path.name}: heading levels jump {skips}"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (lowercased, punctuation dropped, spaces as -)."""
    titles = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-") for title in titles}


def test_heading_anchors_are_githubs():
    assert heading_anchors("# Any verifier: `target=auto`\n## FP8 states\n") == {
        "any-verifier-targetauto",
        "fp8-states",
    }


def test_readme_links_every_doc_and_every_link_resolves():
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", FENCE.sub("", README.read_text()))
    local = {link for link, _ in links if "://" not in link}
    missing = sorted(link for link in local if not (REPO / link).exists())
    assert not missing, f"README.md links to files that do not exist: {missing}"
    dangling = [
        f"{link}#{anchor}"
        for link, anchor in links
        if anchor and link in local and anchor not in heading_anchors((REPO / link).read_text())
    ]
    assert not dangling, f"README.md links to headings that do not exist: {dangling}"
    docs = {str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")}
    assert not docs - local, f"docs not linked from README.md: {sorted(docs - local)}"
