"""Every `--option` the docs (README.md, docs/*.md) name exists in the parser of the script the text is about.

- In a command of a code block (`python X.py ...`, `accelerate launch ... X.py ...`, `torchrun ... X.py ...`), each
  option after a script belongs to that script, and the options before it to the launcher (accelerate's and
  torchrun's own parsers).
- Elsewhere, an option belongs to the script a paragraph (or table row) names; else to the script the section's
  heading names (`## 7. Inference: moss_image_minimal_inference.py`); else to the document's script (the trainer for
  its guides); else (README, architecture, benchmarks) to any script the docs run.
- Prompt-file options (`--w`, `--h`, ...; the sampler's own tables) are allowed anywhere; `--name_*` stands for the
  options that start with `--name_`.

Parsers come from each script's public `setup_parser()`; a script without one (the converter, the bench scripts)
is run up to its `parse_args` call, which hands the parser over instead of parsing.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from library.sampling import sampler

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PRODUCT_SCRIPTS = ("moss_image_train_network.py", "moss_image_minimal_inference.py", "tools/cache_latents.py",
                   "tools/cache_text_encoder_outputs.py", "networks/convert_moss_image_lora.py", "tools/show_metadata.py")
TRAINER = "moss_image_train_network.py"
DOCUMENT_SCRIPT = {"moss_image_train_network.md": TRAINER, "moss_image_train_network.ja.md": TRAINER,
                   "dataset_config.md": TRAINER}
PROMPT_OPTIONS = {f"--{k}" for k in (*sampler._LINE_OPTIONS, *sampler._OTHER_MODEL_OPTIONS)}

OPTION = re.compile(r"(?<![\w-])--([A-Za-z][\w-]*)(\*?)")
SCRIPT = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.py)\b")
LAUNCHERS = re.compile(r"^(?:.*?\s)?(python3?|accelerate\s+launch|torchrun)\s+(.*)$")


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _hand_over(self: argparse.ArgumentParser, *args, **kwargs):
    raise _Captured(self)


def _module(script: str):
    return importlib.import_module(script[: -len(".py")].replace("/", "."))


@cache
def is_command(script: str) -> bool:
    """A repository file that is run with options (a parser or a main), not a module the docs point to."""
    module = _module(script)
    return hasattr(module, "setup_parser") or hasattr(module, "main")


@cache
def options_of(script: str) -> frozenset[str]:
    """The option strings of a repository script's parser."""
    module = _module(script)
    if hasattr(module, "setup_parser"):
        parser = module.setup_parser()
    else:
        mp = pytest.MonkeyPatch()
        mp.setattr(argparse.ArgumentParser, "parse_args", _hand_over)
        mp.setattr(argparse.ArgumentParser, "parse_known_args", _hand_over)
        argv = ["--", "--help"]  # never parsed: parse_args hands the parser over (a "--" for bench/measure.py)
        mp.setattr(sys, "argv", [script, *argv])
        try:
            takes_argv = bool(inspect.signature(module.main).parameters)
            module.main(argv) if takes_argv else module.main()
        except _Captured as captured:
            parser = captured.parser
        else:
            raise AssertionError(f"{script}: main() returned without building a parser")
        finally:
            mp.undo()
    return frozenset(s for a in parser._actions for s in a.option_strings)


@cache
def launcher_options(launcher: str) -> frozenset[str]:
    if launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    else:
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
    return frozenset(s for a in parser._actions for s in a.option_strings)


@dataclass(frozen=True)
class Mention:
    doc: str
    line: int
    option: str  # "--name", or "--name_*" for a family
    scripts: tuple[str, ...]  # any of these parsers may hold it
    launcher: str | None = None

    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.option}"


def _exists(option: str, names: frozenset[str]) -> bool:
    if option.endswith("*"):
        return any(n.startswith(option[:-1]) for n in names)
    return option in names


def _repo_scripts(text: str) -> list[str]:
    return [s for s in SCRIPT.findall(text) if (REPO / s).is_file() and is_command(s)]


def _scripts_by_section(lines: list[str]) -> dict[int, tuple[str, ...]]:
    """{line number of a heading (0: before the first): the scripts its text names, up to the next heading}."""
    out: dict[int, list[str]] = {0: []}
    current = 0
    for number, line in enumerate(lines, 1):
        if re.match(r"^#+\s", line):
            current = number
            out[current] = []
        else:
            out[current].extend(_repo_scripts(line))
    return {k: tuple(dict.fromkeys(v)) for k, v in out.items()}


def _logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines of a code block with `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in block:
        start, text = pending if pending else (number, "")
        text += " " + line.rstrip().removesuffix("\\")
        pending = (start, text) if line.rstrip().endswith("\\") else None
        if pending is None:
            out.append((start, text.strip()))
    if pending:
        out.append(pending)
    return out


def _module_as_script(words: list[str]) -> list[str]:
    """`-m bench.full_e2e` as the file it runs (`bench/full_e2e.py`), so that module commands are checked too."""
    out: list[str] = []
    for word in words:
        script = word.replace(".", "/") + ".py"
        if out and out[-1] == "-m" and (REPO / script).is_file():
            out[-1] = script
        else:
            out.append(word)
    return out


def _command_mentions(doc: str, number: int, line: str) -> list[Mention] | None:
    """The options of a command line, each with its script (None when the line is not a command)."""
    m = LAUNCHERS.match(line.split(" #", 1)[0])
    if m is None:
        return None
    words = _module_as_script(m.group(2).split())
    launcher = {"python": None, "python3": None, "torchrun": "torchrun"}.get(m.group(1), "accelerate")
    current: str | None = None
    mentions = []
    for word in words:
        if word.endswith(".py") and (REPO / word).is_file() and is_command(word):
            current = word
            continue
        for name, star in OPTION.findall(word.split("=", 1)[0]):
            option = f"--{name}{star}"
            if current is None:
                if launcher is not None:
                    mentions.append(Mention(doc, number, option, (), launcher))
            else:
                mentions.append(Mention(doc, number, option, (current,)))
    return mentions if current is not None else None


def _prose_text(line: str) -> str:
    return re.sub(r"\]\([^)]*\)", "]", line)  # link targets are anchors and paths, not options


class _DocScanner:
    """The mentions of one document: code blocks, headings, paragraphs and table rows in order."""

    def __init__(self, doc: str, lines: list[str]) -> None:
        self.doc = doc
        self.lines = lines
        self.mentions: list[Mention] = []
        self.headings: dict[int, tuple[str, ...]] = {}
        self.heading_scripts: tuple[str, ...] = ()
        self.named_in_section = _scripts_by_section(lines)
        self.section = 0
        self.paragraph: list[tuple[int, str]] = []

    def _candidates(self) -> tuple[str, ...]:
        named = tuple(_repo_scripts(" ".join(t for _, t in self.paragraph)))
        if self.heading_scripts:  # a section about one script: its options (and those of a script named alongside)
            return (*self.heading_scripts, *named)
        default = (DOCUMENT_SCRIPT[self.doc],) if self.doc in DOCUMENT_SCRIPT else ()
        return (*default, *self.named_in_section[self.section], *named) if default or named else ()

    def flush(self) -> None:
        scripts = self._candidates()
        for number, text in self.paragraph:
            for name, star in OPTION.findall(_prose_text(text)):
                self.mentions.append(Mention(self.doc, number, f"--{name}{star}", scripts))
        self.paragraph.clear()

    def _code_block(self, block: list[tuple[int, str]]) -> None:
        for start, text in _logical_lines(block):
            found = _command_mentions(self.doc, start, text)
            if found is None:  # a comment, a prompt line, TOML: prose of its section
                self.paragraph.append((start, text))
                self.flush()
            else:
                self.mentions.extend(found)

    def _heading(self, number: int, level: int, line: str) -> None:
        self.headings = {k: v for k, v in self.headings.items() if k < level}
        self.headings[level] = tuple(_repo_scripts(line)) if level > 1 else ()  # a title: the document's
        self.heading_scripts = next((v for _, v in sorted(self.headings.items(), reverse=True) if v), ())
        self.section = number

    def scan(self) -> list[Mention]:
        block: list[tuple[int, str]] | None = None
        for number, line in enumerate(self.lines, 1):
            if line.lstrip().startswith("```"):
                self.flush()
                if block is not None:
                    self._code_block(block)
                block = [] if block is None else None
            elif block is not None:
                block.append((number, line))
            elif heading := re.match(r"^(#+)\s", line):
                self.flush()
                self._heading(number, len(heading.group(1)), line)
            elif not line.strip() or line.lstrip().startswith("|"):
                self.flush()
                if line.strip():  # a table row is a paragraph of its own
                    self.paragraph.append((number, line))
                    self.flush()
            else:
                self.paragraph.append((number, line))
        self.flush()
        return self.mentions


def collect_mentions() -> tuple[list[Mention], list[str]]:
    """Every option mention of the docs, and every script they name (each may hold an option named in general)."""
    mentions: list[Mention] = []
    every_script = set(PRODUCT_SCRIPTS)
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        every_script.update(_repo_scripts("\n".join(lines)))
        mentions.extend(_DocScanner(path.name, lines).scan())
    return mentions, sorted(every_script)


def unknown_options(mentions: list[Mention], scripts: list[str]) -> list[str]:
    """The mentions whose option is in none of the parsers they may belong to."""
    anywhere = frozenset().union(*(options_of(s) for s in scripts))
    launchers = launcher_options("accelerate") | launcher_options("torchrun")
    unknown = []
    for m in mentions:
        if m.option in PROMPT_OPTIONS or (m.launcher is None and _exists(m.option, launchers)):
            continue  # prompt-file options; accelerate's / torchrun's options named in the text
        if m.launcher is not None:
            names = launcher_options(m.launcher)
        elif m.scripts:
            names = frozenset().union(*(options_of(s) for s in m.scripts))
        else:
            names = anywhere
        if not _exists(m.option, names):
            unknown.append(f"{m.where()} (not in {', '.join(dict.fromkeys(m.scripts)) or m.launcher or 'any script'})")
    return unknown


def test_every_documented_option_exists_in_its_scripts_parser():
    mentions, scripts = collect_mentions()
    assert len(mentions) > 300  # the collector found the options (the guides name several hundred)
    unknown = unknown_options(mentions, scripts)
    assert not unknown, "documented options missing from the parsers:\n" + "\n".join(unknown)


def test_the_check_catches_wrong_options(tmp_path, monkeypatch):
    doc = tmp_path / "moss_image_train_network.md"
    doc.write_text("# Title of `moss_image_train_network.py`\n\n"
                   "## 7. Inference: `moss_image_minimal_inference.py`\n\n`--learning_rate` is a training option.\n\n"
                   "```bash\npython moss_image_minimal_inference.py --prompt x \\\n  --no_such_option 1\n"
                   "accelerate launch --num_processes 2 --bogus_launcher_option moss_image_train_network.py --seed 1\n```\n"
                   "## 8. Back to training\n\n| `--learning_rate`, `--compile_*`, `--w`, `--num_machines` | fine |\n"
                   "The [link](#42---not-an-option) and `--image_size` of `moss_image_minimal_inference.py`.\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    mentions, scripts = collect_mentions()
    assert [m.option for m in mentions] == ["--learning_rate", "--prompt", "--no_such_option", "--num_processes",
                                            "--bogus_launcher_option", "--seed", "--learning_rate", "--compile_*",
                                            "--w", "--num_machines", "--image_size"]
    assert unknown_options(mentions, scripts) == [
        "moss_image_train_network.md:5: --learning_rate (not in moss_image_minimal_inference.py)",
        "moss_image_train_network.md:8: --no_such_option (not in moss_image_minimal_inference.py)",
        "moss_image_train_network.md:10: --bogus_launcher_option (not in accelerate)",
    ]
