"""The documentation: a short README whose links resolve, docs pages that mkdocs knows, a configuration
reference that matches the schema, the fast test tier's marking, and typer's shell completion."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from partrain.blueprint.config import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
"""A markdown link's target (images excluded)."""


def _markdown_files():
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading, for the headings these pages use."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def _anchors(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def test_the_readme_is_short_and_keeps_the_quickstart_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "pip install -c .ci/constraints.txt -e . && partrain train recipe=gpt-3d" in text
    assert "pip install -c .ci/constraints.txt -e '.[dev]' && python -m pytest -q tests" in text


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_in_the_mkdocs_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for item in node.values():
                yield from pages(item)

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk == listed, f"pages not in mkdocs.yml's nav: {on_disk - listed}; missing: {listed - on_disk}"


def test_every_config_key_has_a_docstring():
    assert reference.undocumented_keys() == [], "give each of these a docstring in schema.py"


def test_the_config_reference_page_is_up_to_date():
    committed = (DOCS / "config-reference.md").read_text()
    assert committed == reference.render(), (
        f"docs/config-reference.md is stale: regenerate it with `{reference.REGENERATE}`"
    )


def test_the_model_families_page_is_up_to_date():
    from partrain.blueprint.families import FAMILIES, support

    committed = (DOCS / "families.md").read_text()
    regenerate = "python -m partrain.blueprint.families.support > docs/families.md"
    assert committed == support.render(), f"docs/families.md is stale: regenerate it with `{regenerate}`"
    assert set(support.PARITY_FAMILIES) <= set(FAMILIES)
    assert set(support.FAMILY_NOTES) == set(support.PARITY_FAMILIES)


def test_the_reference_lists_every_key_with_its_choices():
    page = reference.render()
    for key in ("model.arch", "parallel.zero_stage", "train.precision", "checkpoint.export_dtype", "recipe"):
        assert f"| `{key}` |" in page
    assert "One of: `gpipe`, `1f1b`" in page  # parallel.pp_schedule's CHOICES


def test_the_fast_tier_marks_every_multi_process_file_slow():
    import conftest

    class Item(SimpleNamespace):
        def add_marker(self, mark):
            self.marks.append(mark.name)

    items = [Item(nodeid=f"tests/{name}::test_x", marks=[]) for name in ("test_cli.py", "test_lora.py")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [[], ["slow"]]


def test_show_completion_prints_a_bash_script(run_partrain):
    ran = run_partrain("--show-completion", "bash")
    assert ran.code == 0, ran.stderr
    assert "_PARTRAIN_COMPLETE" in ran.stdout and "complete " in ran.stdout


def test_the_sdist_ships_what_the_readme_links_and_these_tests_read():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = set(config["tool"]["hatch"]["build"]["targets"]["sdist"]["include"])
    assert {"docs", "mkdocs.yml", "README.md"} <= shipped
    local = [t for t in LINK.findall((ROOT / "README.md").read_text()) if "://" not in t and not t.startswith("#")]
    missing = {t for t in local if Path(t.partition("#")[0]).parts[0] not in shipped}
    assert not missing, f"README links to files the sdist leaves out: {sorted(missing)}"
