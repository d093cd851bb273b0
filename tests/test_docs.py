"""The documentation holds together (issue 66): every relative link of the front page, docs/ and mop's own
README.md files reaches a file, and its `#anchor` a heading there (GitHub's slugs); the front page stays a front
page; and the commands the pages show run as written: each `./mop.sh` / `mop` sub-command is one the parser has and
takes the options given, every path into the repository exists, and every --section.key=value is a key of the
config (`mop.config.load_config`, which refuses an unknown one). Nothing is launched."""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

from mop.cli import build_parser, rl_config
from mop.config import ConfigError, hints, load_config, sections

ROOT = Path(__file__).resolve().parents[1]
FRONT_PAGE = ROOT / "README.md"
PAGES = [FRONT_PAGE, *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*PAGES, *sorted((ROOT / "mop").rglob("README.md"))]
REPO_PATHS = ("configs/", "tests/", "mop/", "docs/")  # an argument starting so names a file of the repository
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks; a repeated one gets -1, -2, ... as on GitHub)."""
    found, times = set(), {}
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).split("\n"):
        if match := re.match(r"#{1,6} (.*)", line):
            name = slug(match.group(1))
            found.add(f"{name}-{times[name]}" if name in times else name)
            times[name] = times.get(name, 0) + 1
    return found


def test_every_relative_link_reaches_a_file_and_its_anchor_a_heading():
    broken = []
    for page in LINKED:
        prose = re.sub(r"`[^`]*`", "", FENCE.sub("", page.read_text(encoding="utf-8")))
        for target in LINK.findall(prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_front_page_is_a_front_page():
    lines = FRONT_PAGE.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move guides to docs/"


def shown_commands(page: Path) -> list[str]:
    """The commands of a page's bash blocks, and the `$ ` lines of its other blocks (a block showing an error,
    `mop: error: ...`, shows a command that fails on purpose); continued lines joined."""
    commands = []
    for language, body in FENCE.findall(page.read_text(encoding="utf-8")):
        body = re.sub(r"\\\n\s*", " ", body)
        lines = [line.strip() for line in body.split("\n")]
        if language == "bash":
            commands += [line for line in lines if line and not line.startswith("#")]
        elif not any(line.startswith("mop: error:") for line in lines):
            commands += [line[2:] for line in lines if line.startswith("$ ")]
    return commands


def placeholder(token: str) -> bool:
    return "$" in token or bool(re.search(r"<[^>]*>", token)) or token == "..."


@functools.cache
def parser(benchmark: str | None):
    return build_parser(benchmark)


@functools.cache
def mop_sh_commands() -> set[str]:
    """The sub-commands mop.sh answers itself (its `case` labels); any other goes to `mop`."""
    return set(re.findall(r"^\s+(\w+)\)$", (ROOT / "mop.sh").read_text(), flags=re.M))


def check_paths(tokens: list[str]) -> list[str]:
    """Every argument (or --option=value) naming a path of the repository, and every `-m mop.module`, exists."""
    wrong = []
    for previous, token in zip(["", *tokens], tokens):
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if placeholder(value):
            continue
        if value.startswith(REPO_PATHS) and not (ROOT / value).exists():
            wrong.append(f"{value}: no such file in the repository")
        if previous == "-m" and value.startswith("mop."):
            module = ROOT / value.replace(".", "/")
            if not (module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()):
                wrong.append(f"-m {value}: no such module")
    return wrong


def check_mop(argv: list[str]) -> list[str]:
    """`mop ARGV` as its parser and config read it (what `mop.cli.main` does before it runs anything)."""
    argv = [arg for arg in argv if arg not in ("--help", "-h", "...")]
    open_settings = [arg for arg in argv if arg.startswith("--") and "." in arg.split("=")[0] and placeholder(arg)]
    argv = ["PLACEHOLDER" if placeholder(arg) else arg for arg in argv if arg not in open_settings]
    try:
        args, rest = parser(argv[1] if argv[:1] == ["bench"] and len(argv) > 1 else None).parse_known_args(argv)
    except SystemExit:
        return ["the parser refuses it (its line is in the captured stderr)"]
    if args.command not in ("train", "rl"):
        if args.command == "plan" and args.model != "PLACEHOLDER":
            from mop.plan import load_model

            try:
                load_model(args.model)
            except ConfigError as err:
                return [str(err)]
        return [f"unrecognised arguments: {rest}"] if rest else []
    wrong = [f"{arg}: not a --section.key=value setting" for arg in rest
             if not (arg.startswith("--") and "." in arg.split("=", 1)[0])]
    for arg in open_settings:  # a placeholder value: the key alone must be one of the config's
        section, _, key = arg.split("=", 1)[0].removeprefix("--").partition(".")
        if section not in sections() or key not in hints(sections()[section]):
            wrong.append(f"{arg}: unknown key")
    config = args.config if args.config and (ROOT / args.config).is_file() else None
    try:
        settings = load_config(ROOT / config if config else None, rest)
        if args.command == "rl" and config:
            rl_config(settings)
    except ConfigError as err:
        wrong.append(str(err))
    return wrong


def test_the_shown_commands_run_as_written():
    wrong = []
    for page in PAGES:
        for line in shown_commands(page):
            for segment in re.split(r"\s(?:\|\|?|&&|;)\s", line):
                tokens = shlex.split(segment, comments=True)
                problems = check_paths(tokens)
                for i, token in enumerate(tokens):
                    argv = tokens[i + 1:]
                    if token == "./mop.sh" and argv[:1] and argv[0] in mop_sh_commands():
                        break
                    if token in ("mop", "./mop.sh") or token == "mop.cli" and i and tokens[i - 1] == "-m":
                        problems += check_mop(argv)
                        break
                wrong += [f"{page.relative_to(ROOT)}: {segment}: {problem}" for problem in problems]
    assert not wrong, "\n".join(wrong)
