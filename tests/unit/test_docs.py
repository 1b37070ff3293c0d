"""The documentation cannot rot: its snippets run, its links resolve, the site builds with ``--strict``.

- Every script under ``examples/`` that the pages include is run here, as a
  user would run it (separate gloo processes with torchrun's variables), and
  its outcome is checked: checkpoints written, a resume from the pointer, an
  injected fault stopping every rank with the alarm exit code, a changed byte
  refused.
- The README's adoption snippet is the text of ``examples/adopt_minimal.py``.
- Every relative link in the README, the changelog and ``docs/`` names a file
  that exists.
- The generated parts of the pages (the reference, the template's tables, the
  example diff, the included example) are committed in the Markdown, so they
  read whole on the repository page, and are what ``docs/hooks.py`` generates
  from the code now (``python docs/hooks.py`` rewrites them).
- ``mkdocs build --strict`` passes, and the generated reference covers every
  command and every schema.

Each check is also fed a broken input, to show it can fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ALARM_EXIT_CODE = 87


def _readme() -> Path:
    return ROOT / "README.md"


def test_the_readme_stays_short() -> None:
    assert len(_readme().read_text().splitlines()) < 200


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sdcguard_docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- running the examples -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(script: Path, nproc: int, cwd: Path, env: dict[str, str], *, ranks_per_node: int,
               timeout: float = 240) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` as ``nproc`` ranks with the variables torchrun sets; each rank's result."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SDCGUARD_", "AWS_"))}
    base.update({
        "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(ranks_per_node),
        # Nothing may reach a real account: EventBridge is a closed port on loopback.
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        **env,
    })
    procs = [
        subprocess.Popen([sys.executable, str(script)], cwd=cwd, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank % ranks_per_node)})
        for rank in range(nproc)
    ]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _pointer_step(prefix: Path) -> int:
    return int(json.loads((prefix / "RESUME.json").read_text())["step"])


def _committed(prefix: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in (prefix / "checkpoints").iterdir()
                  if (d / "MANIFEST.json").exists())


@pytest.mark.slow
def test_the_adoption_example_guards_checkpoints_and_resumes(tmp_path: Path) -> None:
    """examples/adopt_minimal.py on 2 ranks as 2 simulated nodes (so the ring audit runs)."""
    prefix, spool = tmp_path / "ckpt", tmp_path / "spool"
    settings = {"SDCGUARD_RANKS_PER_NODE": "1", "SDCGUARD_AUDIT_EVERY": "2", "SDCGUARD_FINGERPRINT_EVERY": "2",
                "SDCGUARD_CHECKPOINT_PREFIX": str(prefix), "SDCGUARD_SPOOL_DIR": str(spool),
                "SDCGUARD_PUBLISH_BUDGET_S": "2", "SAVE_EVERY": "2"}

    # Given a GPU that makes a NaN at step 4: every rank stops with the alarm's exit code, after the
    # checkpoints of steps 2 and 4, and the alarm (EventBridge unreachable) is spooled naming rank 1.
    faulty = _run_ranks(EXAMPLES / "adopt_minimal.py", 2, tmp_path, {
        **settings, "STEPS": "8", "SDCGUARD_INJECT": "kind=nan_activation,rank=1,step=4"}, ranks_per_node=1)
    assert [r.returncode for r in faulty] == [ALARM_EXIT_CODE] * 2, [r.stderr[-2000:] for r in faulty]
    assert _committed(prefix) == [2, 4]
    alarms = [json.loads(p.read_text()) for p in spool.glob("alarm-*.json")]
    assert len(alarms) == 1
    assert alarms[0]["step"] == 4
    assert [s["global_rank"] for s in alarms[0]["suspects"]] == [1]

    # When it starts again without the fault: it resumes from the pointer (step 4), runs to the end and
    # moves the pointer to its new checkpoint.
    clean = _run_ranks(EXAMPLES / "adopt_minimal.py", 2, tmp_path, {**settings, "STEPS": "6"}, ranks_per_node=1)
    assert [r.returncode for r in clean] == [0, 0], [r.stderr[-2000:] for r in clean]
    assert "resumed from" in clean[0].stderr
    assert "step 4" in clean[0].stderr
    assert _committed(prefix) == [2, 4, 6]
    assert _pointer_step(prefix) == 6
    assert "ring audit off" not in clean[0].stderr


@pytest.mark.slow
def test_the_checkpoint_writer_example_resumes_and_refuses_changed_bytes(tmp_path: Path) -> None:
    """examples/checkpoint_writer.py, one rank: a save, a resume from the pointer, a changed byte refused."""
    prefix = tmp_path / "ckpt"
    env = {"CHECKPOINT_PREFIX": str(prefix), "SAVE_EVERY": "2"}
    script = EXAMPLES / "checkpoint_writer.py"

    first = _run_ranks(script, 1, tmp_path, {**env, "STEPS": "4"}, ranks_per_node=1)[0]
    assert first.returncode == 0, first.stderr[-2000:]
    assert "starting at step 0" in first.stdout
    assert _committed(prefix) == [2, 4]
    assert _pointer_step(prefix) == 4

    again = _run_ranks(script, 1, tmp_path, {**env, "STEPS": "6"}, ranks_per_node=1)[0]
    assert again.returncode == 0, again.stderr[-2000:]
    assert "starting at step 4" in again.stdout
    assert _pointer_step(prefix) == 6

    # Given a byte changed after the manifest was written, the next start refuses to train from it.
    model = prefix / "checkpoints" / "step-000000006" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    refused = _run_ranks(script, 1, tmp_path, {**env, "STEPS": "8"}, ranks_per_node=1)[0]
    assert refused.returncode != 0
    assert "CheckpointCorrupt" in refused.stderr
    assert "model.pt" in refused.stderr
    assert "starting at step" not in refused.stdout


# -- the README's snippet is the example ------------------------------------------------------------


def fenced_blocks(markdown: str, language: str) -> list[str]:
    """The contents of every ```language fenced block, in order."""
    return [m.group(1) for m in re.finditer(rf"^```{language}\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)]


def test_the_readme_snippet_is_the_adoption_example() -> None:
    example = (EXAMPLES / "adopt_minimal.py").read_text()
    assert example in fenced_blocks(_readme().read_text(), "python")


def test_the_snippet_check_notices_a_changed_copy() -> None:
    example = (EXAMPLES / "adopt_minimal.py").read_text()
    changed = _readme().read_text().replace("GuardConfig.from_env()", "GuardConfig.from_env(audit_every=100)")
    assert example not in fenced_blocks(changed, "python")


def test_the_docs_show_the_examples_from_the_files() -> None:
    pages = {p.name: p.read_text() for p in (ROOT / "docs").rglob("*.md")}
    assert "<!-- generated: file examples/adopt_minimal.py -->" in pages["adopting.md"]
    assert (EXAMPLES / "adopt_minimal.py").read_text() in fenced_blocks(pages["adopting.md"], "python")
    assert "<!-- generated: file examples/checkpoint_writer.py -->" in pages["checkpoints.md"]
    assert (EXAMPLES / "checkpoint_writer.py").read_text() in fenced_blocks(pages["checkpoints.md"], "python")
    for name, text in pages.items():
        for block in fenced_blocks(text, "python"):
            assert "ddp_model" not in block, name
            assert "agreed_hex" not in block, name


# -- relative links -----------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(markdown: str) -> str:
    """Markdown without fenced code blocks and inline code, where links are not links."""
    without_fences = re.sub(r"^(```|~~~).*?^\1[ \t]*$", "", markdown, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", without_fences)


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` whose file does not exist (anchors are mkdocs' to check)."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def _pages() -> list[Path]:
    return [_readme(), ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#a) [gone](missing.md) [web](https://example.com) `[code](nowhere.md)`\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.md"]


# -- the generated reference and the site ---------------------------------------------------------------


def test_the_cli_reference_has_every_command_and_subcommand() -> None:
    text = _hooks().cli_help(ROOT)
    from sdcguard.cli import COMMANDS

    for name in COMMANDS:
        assert f"`sdcguard {name}`" in text
    for nested in ("local up", "local seed", "checkpoints list", "checkpoints select", "incidents show"):
        assert f"`sdcguard {nested}`" in text
    assert "usage: sdcguard drill" in text


def test_the_contract_reference_has_every_schema() -> None:
    text = _hooks().schemas(ROOT)
    for path in (ROOT / "contract" / "schemas").glob("*.schema.json"):
        assert f"`contract/schemas/{path.name}`" in text
        assert f"## {json.loads(path.read_text())['title']}\n" in text


def test_the_template_reference_lists_every_output() -> None:
    hooks = _hooks()
    outputs = hooks._template(ROOT)["Outputs"]
    text = hooks.template_outputs(ROOT)
    assert all(f"`{name}`" in text for name in outputs)
    sample = (ROOT / "docs" / "deploying.md").read_text()
    assert all(f"  {name} = " in sample for name in outputs), "the deploy output sample omits an output"


def test_an_unknown_generated_part_fails_the_build() -> None:
    with pytest.raises(ValueError, match="unknown generated part 'clii'"):
        _hooks().expand("# page\n\n<!-- generated: clii -->\n\n<!-- end generated: clii -->\n", ROOT, "page.md")


def test_a_marker_without_its_partner_fails_the_build() -> None:
    hooks = _hooks()
    with pytest.raises(ValueError, match=r"page.md:3: a generated-part marker without its partner"):
        hooks.expand("# page\n\n<!-- generated: cli -->\n\ntext\n", ROOT, "page.md")
    with pytest.raises(ValueError, match=r"page.md:3: a generated-part marker without its partner"):
        hooks.expand("# page\n\n<!-- end generated: cli -->\n", ROOT, "page.md")


def test_the_generated_parts_are_committed_and_fresh() -> None:
    hooks = _hooks()
    stale = [str(p.relative_to(ROOT)) for p in hooks.stale_pages(ROOT)]
    assert stale == [], f"stale generated parts in {stale}: run `{hooks.REGENERATE}` and commit the pages"
    pages = {str(p.relative_to(ROOT)) for p in hooks.pages(ROOT)}
    assert {"docs/adopting.md", "docs/deploying.md", "docs/reference/cli.md", "docs/reference/contract.md",
            "docs/reference/guard-config.md"} <= pages


def test_a_stale_part_is_found_and_rewritten() -> None:
    hooks = _hooks()
    stale = "# page\n\n<!-- generated: template-outputs -->\n\n| output | what |\n\n<!-- end generated: template-outputs -->\n"
    fresh = hooks.expand(stale, ROOT, "page.md")
    assert fresh != stale
    assert hooks.template_outputs(ROOT).rstrip("\n") in fresh
    assert hooks.expand(fresh, ROOT, "page.md") == fresh


def _mkdocs_build(cwd: Path, site: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    # Not --quiet: it hides the warnings that --strict counts, and a broken link would pass.
    return subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(site)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
def test_a_broken_link_or_anchor_fails_a_strict_build_under_our_settings(tmp_path: Path) -> None:
    import yaml

    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n## Here\n\n[fine](#here) [gone](missing.md)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n[no anchor](index.md#nowhere)\n")
    site = {"site_name": "t", "docs_dir": "docs", "nav": ["index.md", "other.md"],
            "markdown_extensions": ["toc"], "validation": ours["validation"]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(site))
    done = _mkdocs_build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stderr
    assert "#nowhere" in done.stderr


@pytest.mark.slow
def test_the_site_builds_with_strict(tmp_path: Path) -> None:
    done = _mkdocs_build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    adopting = (tmp_path / "site" / "adopting" / "index.html").read_text()
    assert "init_process_group" in adopting  # the example was included, not left as a snippet line
    reference = (tmp_path / "site" / "reference" / "guard-config" / "index.html").read_text()
    assert "SDCGUARD_AUDIT_EVERY" in reference
    assert "Run the ring re-execution audit" in reference
