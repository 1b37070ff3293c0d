"""The parts of the docs generated from the code, committed in the pages, and kept fresh.

A page holds each generated part between two marker comments, so that the
Markdown reads whole on the repository page as well as on the site::

    <!-- generated: NAME -->

    ...the generated Markdown, committed...

    <!-- end generated: NAME -->

``python docs/hooks.py`` (with ``.venv`` active, from the repository root)
rewrites every part of every page from the code; ``--check`` only lists the
pages whose committed text is stale and exits 1 (``tests/unit/test_docs.py``
runs it). When the site is built, the mkdocs hook below regenerates the parts
too, so the site never shows a stale one. The parts:

    cli                  every sdcguard command's --help (sdcguard.cli.build_parser)
    schemas              contract/schemas/*.json: fields, types, constraints, the schema
    guard-config-env     GuardConfig's fields, their SDCGUARD_* variable, default and docstring
    template-parameters  the CloudFormation template's parameters
    template-outputs     and its outputs
    gpt-example-diff     the diff of examples/gpt_ddp_plain.py and gpt_ddp_guarded.py
    file PATH            a file of the repository as a fenced block (``file examples/adopt_minimal.py``)

An unknown part, a start marker without its end marker, or an end marker
without its start fails, so a typo cannot leave a page silently empty or stale.

The functions take the repository root and return Markdown, so the tests call
them without mkdocs.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(
    r"^<!-- generated: (?P<part>[a-z-]+(?: [^ >]+)?) -->\n(?P<body>.*?)^<!-- end generated: (?P=part) -->$",
    re.MULTILINE | re.DOTALL)
STARTS = re.compile(r"^<!-- (?:end )?generated: .*-->$", re.MULTILINE)
REGENERATE = "python docs/hooks.py"
HELP_WIDTH = 96


@contextlib.contextmanager
def _importable(root: Path) -> Iterator[None]:
    """The project's packages importable from ``root`` (mkdocs runs hooks without the root on sys.path)."""
    added = str(root) not in sys.path
    if added:
        sys.path.insert(0, str(root))
    try:
        yield
    finally:
        if added:
            sys.path.remove(str(root))


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    # argparse wraps help to the terminal's width: fix it, so a build does not depend on who runs it.
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width + 2)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_help(root: Path = ROOT) -> str:
    """Every command's ``--help``, the top level first, then each subcommand in --help order, depth first."""
    with _importable(root):
        from sdcguard.cli import build_parser

        parser = build_parser()
    out: list[str] = []

    def visit(name: str, p: argparse.ArgumentParser, depth: int) -> None:
        out.append(f"{'#' * min(depth + 2, 6)} `{name}`\n")
        with _columns(HELP_WIDTH):
            out.append(f"```text\n{p.format_help().rstrip()}\n```\n")
        for sub, child in _subcommands(p).items():
            visit(f"{name} {sub}", child, depth + 1)

    visit("sdcguard", parser, 0)
    return "\n".join(out)


def _type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type_of(s) for s in schema[key])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type_of(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map to {_type_of(schema['additionalProperties'])}"
    return str(kind)


_CONSTRAINTS = ("minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "pattern", "minItems",
                "maxItems", "format")


def _constraints(schema: dict[str, Any]) -> str:
    parts = [f"{k} `{schema[k]}`" for k in _CONSTRAINTS if k in schema]
    if "default" in schema:
        parts.append(f"default `{json.dumps(schema['default'])}`")
    return ", ".join(parts).replace("|", "\\|")


def _one_line(text: str) -> str:
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def _fields_table(schema: dict[str, Any]) -> list[str]:
    props: dict[str, Any] = schema.get("properties", {})
    if not props:
        return []
    required = set(schema.get("required", []))
    rows = ["| field | type | required | constraints | description |", "|---|---|---|---|---|"]
    for name, prop in props.items():
        rows.append(f"| `{name}` | {_type_of(prop)} | {'yes' if name in required else ''} | "
                    f"{_constraints(prop)} | {_one_line(prop.get('description', ''))} |")
    return rows


def schemas(root: Path = ROOT) -> str:
    """One section per checked-in JSON Schema: its description, its fields and those of its definitions."""
    out: list[str] = []
    for path in sorted((root / "contract" / "schemas").glob("*.schema.json")):
        schema = json.loads(path.read_text())
        title = schema.get("title", path.name)
        out += [f"## {title}", "", f"`contract/schemas/{path.name}` (`sdcguard schema {path.name.split('.')[0]}`)",
                "", _one_line(schema.get("description", "")), "", *_fields_table(schema), ""]
        for name, sub in schema.get("$defs", {}).items():
            # The anchor must be unique on the page; a definition shared by two schemas is listed under each.
            # "Alarm: Suspect" slugs to #alarm-suspect on the site and on the repository page alike.
            out += [f"### {title}: {name}", "", _one_line(sub.get("description", "")), ""]
            table = _fields_table(sub)
            out += table or ([f"{_type_of(sub)}", ""] if sub.get("enum") or sub.get("type") else [])
            out.append("")
        # <details> folds on the repository page and, with md_in_html, on the site.
        out += ['<details markdown="1"><summary>The whole schema</summary>', "", "```json",
                *json.dumps(schema, indent=2).splitlines(), "```", "", "</details>", ""]
    # Links to definitions point at the section of the schema they are in.
    return _scope_def_links("\n".join(out))


def _scope_def_links(text: str) -> str:
    """``[Name](#name)`` inside a schema's section becomes ``[Name](#title-name)``."""
    parts = re.split(r"^(## .+)$", text, flags=re.MULTILINE)
    out = [parts[0]]
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        title = heading[3:].strip().lower()
        out.append(heading)
        out.append(re.sub(r"\]\(#([a-z0-9_]+)\)", lambda m, t=title: f"](#{t}-{m.group(1)})", body))
    return "".join(out)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source (Python keeps none at run time)."""
    source = Path(inspect.getsourcefile(cls) or "").read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            docs: dict[str, str] = {}
            for field, doc in zip(node.body, node.body[1:], strict=False):
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    docs[field.target.id] = doc.value.value
            return docs
    return {}


def guard_config_env(root: Path = ROOT) -> str:
    """A table of GuardConfig's fields: the variable that sets each, its type, its default and what it does."""
    with _importable(root):
        import typing

        from sdcguard.agent.config import ENV_PREFIX, GuardConfig

    hints = typing.get_type_hints(GuardConfig)
    docs = _field_docs(GuardConfig)
    rows = ["| field | variable | type | default | what it does |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(GuardConfig):
        kind = str(hints[f.name]).replace("typing.", "").replace("|", "or")
        if isinstance(hints[f.name], type):
            kind = hints[f.name].__name__
        rows.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | {kind} | `{f.default!r}` | "
                    f"{_one_line(docs.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def _template(root: Path) -> dict[str, Any]:
    with _importable(root):
        from sdcguard.infra.deploy.cfn_yaml import load_template

    return load_template(root / "infra" / "deploy" / "template.yaml")


def template_parameters(root: Path = ROOT) -> str:
    """The template's parameters: default (or required), allowed values, description."""
    rows = ["| parameter | default | allowed | what |", "|---|---|---|---|"]
    for name, spec in _template(root)["Parameters"].items():
        default = "required" if "Default" not in spec else f"`{spec['Default']!r}`" if spec["Default"] != "" else "empty"
        allowed = ", ".join(f"`{v}`" for v in spec.get("AllowedValues", []))
        if "MinValue" in spec or "MaxValue" in spec:
            allowed = f"{spec.get('MinValue', '')}..{spec.get('MaxValue', '')}"
        rows.append(f"| `{name}` | {default} | {allowed} | {_one_line(str(spec.get('Description', '')))} |")
    return "\n".join(rows) + "\n"


def template_outputs(root: Path = ROOT) -> str:
    """The template's outputs with their descriptions."""
    rows = ["| output | what |", "|---|---|"]
    for name, spec in _template(root)["Outputs"].items():
        rows.append(f"| `{name}` | {_one_line(str(spec.get('Description', '')))} |")
    return "\n".join(rows) + "\n"


PLAIN_EXAMPLE, GUARDED_EXAMPLE = "examples/gpt_ddp_plain.py", "examples/gpt_ddp_guarded.py"
_IMPORT = re.compile(r"^(import \S|from \S+ import )")
CONTEXT = 2
"""Lines of context around each change (three would join the imports to the docstring's hunk)."""
_HELP = re.compile(r", help=(\"[^\"]*\"|'[^']*')")


def _docstring_end(lines: list[str]) -> int:
    """The number of lines the module docstring spans (0 without one)."""
    body = ast.parse("\n".join(lines)).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno or 0
    return 0


def _noise(op: str, removed: list[tuple[int, str]], added: list[tuple[int, str]], doc_a: int, doc_b: int) -> bool:
    """True when a change is only the docstring, an import the guarded file no longer needs, or a help text."""
    if all(i < doc_a for i, _ in removed) and all(j < doc_b for j, _ in added):
        return True
    if not added and all(_IMPORT.match(line) for _, line in removed):
        return True
    return (op == "replace" and len(removed) == len(added)
            and all("add_argument(" in a and _HELP.sub("", a) == _HELP.sub("", b)
                    for (_, a), (_, b) in zip(removed, added, strict=True)))


def gpt_example_diff(root: Path = ROOT, plain: str = PLAIN_EXAMPLE, guarded: str = GUARDED_EXAMPLE) -> str:
    """``diff -u`` of the plain and the guarded GPT example, as a fenced block, without the noise.

    Hunks whose every change is the docstring, an import the guarded file no
    longer needs, or a help text added to an argument are left out (and
    counted in the line under the block); a hunk with any other change is
    shown whole, so no change that adopting the guard takes can be hidden.
    """
    a = (root / plain).read_text().splitlines()
    b = (root / guarded).read_text().splitlines()
    doc_a, doc_b = _docstring_end(a), _docstring_end(b)
    shown: list[str] = [f"--- {plain}", f"+++ {guarded}"]
    left_out = 0
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(CONTEXT):
        changes = [(op, [(i, a[i]) for i in range(i1, i2)], [(j, b[j]) for j in range(j1, j2)])
                   for op, i1, i2, j1, j2 in group if op != "equal"]
        if all(_noise(op, rem, add, doc_a, doc_b) for op, rem, add in changes):
            left_out += 1
            continue
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        shown.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for op, x1, x2, y1, y2 in group:
            if op == "equal":
                shown += [" " + line for line in a[x1:x2]]
                continue
            shown += ["-" + line for line in a[x1:x2]]
            shown += ["+" + line for line in b[y1:y2]]
    note = (f"{left_out} hunk{'s' if left_out != 1 else ''} left out: only the docstring, imports the guarded file "
            "no longer needs, or a help text.")
    return "```diff\n" + "\n".join(shown) + "\n```\n\n" + note + "\n"


def file_block(root: Path, path: str) -> str:
    """The file ``path`` of the repository as a fenced block, in the language its suffix names."""
    language = {".py": "python", ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".sh": "bash"}
    return f"```{language.get(Path(path).suffix, 'text')}\n{(root / path).read_text().rstrip()}\n```\n"


GENERATORS: dict[str, Callable[[Path], str]] = {
    "cli": cli_help,
    "schemas": schemas,
    "guard-config-env": guard_config_env,
    "template-parameters": template_parameters,
    "template-outputs": template_outputs,
    "gpt-example-diff": gpt_example_diff,
}


def generate(part: str, root: Path = ROOT, where: str = "") -> str:
    """The Markdown of one part (``"cli"``, ``"file examples/x.py"``); raises ``ValueError`` on an unknown one."""
    name, _, arg = part.partition(" ")
    if name == "file" and arg:
        if not (root / arg).is_file():
            raise ValueError(f"{where}: generated part {part!r}: no such file {arg}")
        return file_block(root, arg)
    if name not in GENERATORS or arg:
        raise ValueError(f"{where}: unknown generated part {part!r}; known: {', '.join(GENERATORS)}, file PATH")
    return GENERATORS[name](root)


def expand(markdown: str, root: Path = ROOT, where: str = "") -> str:
    """``markdown`` with every generated part rewritten from the code.

    Raises ``ValueError`` naming the page for an unknown part, or a marker
    without its partner (a start without its end, an end without its start).
    """
    blocks = list(BLOCK.finditer(markdown))
    inside = {m.start() for m in STARTS.finditer(markdown)} - {m.start() for m in blocks} - {
        m.start("body") + len(m.group("body")) for m in blocks}
    if inside:
        line = markdown.count("\n", 0, min(inside)) + 1
        raise ValueError(f"{where}:{line}: a generated-part marker without its partner; a part is written "
                         "<!-- generated: NAME -->, a blank line, the part, a blank line, <!-- end generated: NAME -->")

    def replace(match: re.Match[str]) -> str:
        part = match.group("part")
        body = generate(part, root, where).rstrip("\n")
        return f"<!-- generated: {part} -->\n\n{body}\n\n<!-- end generated: {part} -->"

    return BLOCK.sub(replace, markdown)


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that hold a generated part: the docs' and the README."""
    candidates = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [p for p in candidates if p.is_file() and STARTS.search(p.read_text())]


def stale_pages(root: Path = ROOT) -> list[Path]:
    """The pages whose committed generated parts differ from what the code generates now."""
    return [p for p in pages(root) if expand(p.read_text(), root, str(p.relative_to(root))) != p.read_text()]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs' hook: the site shows every part as the code generates it now, committed text stale or not."""
    return expand(markdown, ROOT, page.file.src_uri)


def main(argv: list[str] | None = None) -> int:
    """``python docs/hooks.py [--check]``: rewrite the stale pages (or, with --check, list them and exit 1)."""
    parser = argparse.ArgumentParser(prog=REGENERATE, description=main.__doc__)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    stale = stale_pages(ROOT)
    for page in stale:
        if args.check:
            print(f"stale: {page.relative_to(ROOT)} (run: {REGENERATE})")
        else:
            page.write_text(expand(page.read_text(), ROOT, str(page.relative_to(ROOT))))
            print(f"rewrote {page.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
