"""docs/configuration.md is generated from the config schema (service/config/schema.py) and cannot drift: the
committed page equals the generator's output, lists every key of each section, and documents no key that does
not exist. Regenerate with ``python -m relserve.service.config.docs``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from relserve.service.config import MODEL_KEYS, SERVER_KEYS
from relserve.service.config.docs import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECTIONS = {"Server keys": SERVER_KEYS, "Model keys": MODEL_KEYS}


def _documented(text: str) -> dict[str, list[str]]:
    """Section title -> the keys of its table, read from the page's text (not from the generator)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        match = re.match(r"^\| `([a-z0-9_]+)` \|", line)
        if match and section is not None:
            out.setdefault(section, []).append(match.group(1))
    return out


def test_page_is_the_generated_one():
    assert PAGE.read_text(encoding="utf-8") == render(), \
        "docs/configuration.md is stale: run `python -m relserve.service.config.docs`"


def test_every_schema_key_is_documented_and_every_documented_key_exists():
    documented = _documented(PAGE.read_text(encoding="utf-8"))
    assert set(documented) == set(SECTIONS)
    for title, keys in SECTIONS.items():
        missing = sorted(set(keys) - set(documented[title]))
        unknown = sorted(set(documented[title]) - set(keys))
        assert not missing, f"{title}: keys missing from docs/configuration.md: {missing}"
        assert not unknown, f"{title}: documented keys that do not exist: {unknown}"
        assert len(documented[title]) == len(set(documented[title])), f"{title}: a key is documented twice"


def test_example_file_uses_only_real_keys():
    text = PAGE.read_text(encoding="utf-8")
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    models = example.pop("models")
    assert set(example) <= set(SERVER_KEYS), sorted(set(example) - set(SERVER_KEYS))
    for entry in models:
        assert set(entry) <= set(MODEL_KEYS), sorted(set(entry) - set(MODEL_KEYS))


def test_the_key_check_reads_the_tables():
    """The check above is not vacuous: it finds every row of the generated page, and a row taken out is missed."""
    page = render()
    assert _documented(page) == {title: list(keys) for title, keys in SECTIONS.items()}
    row = next(line for line in page.splitlines() if line.startswith("| `drain_timeout` |"))
    assert "drain_timeout" not in _documented(page.replace(row + "\n", ""))["Server keys"]
