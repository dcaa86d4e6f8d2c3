"""README's quickstarts run as written: the graph's and the model's (the server's is ``test_server``'s)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def quickstart(title: str) -> str:
    """The first Python block under README's heading ``title``."""
    section = README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_graph_quickstart_runs():
    scope: dict = {}
    exec(compile(quickstart("Quickstart: a graph and a kernel"), str(README), "exec"), scope)
    assert scope["out"]["y"].shape == (1, 128)


@pytest.mark.slow
def test_the_model_quickstart_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(quickstart("Quickstart: a model"), str(README), "exec"), scope)
    ids, more = scope["ids"], scope["more"]
    assert ids.shape == (1, 14) and more[0].shape == (22,) and more[0][:14].tolist() == ids[0].tolist()


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_in_readme_and_docs_resolves():
    """Each link to a file of the repository (README, docs/) names one that exists, and a ``#part`` a heading of
    it."""
    root = README.parent
    broken = []
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, part = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no {file.relative_to(root) if root in file.parents else file})")
            elif part and part not in {anchor(h) for h in re.findall(r"^#+ (.*)$", file.read_text(), re.M)}:
                broken.append(f"{page.name}: {target} (no heading #{part} in {file.name})")
    assert not broken, broken
