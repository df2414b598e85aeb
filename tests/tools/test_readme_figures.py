"""Every figure in the README's "Headline results" table is in the section it
links to: each number of a row (claim and figure) must appear, as a number, in
the linked section of the linked doc, and the link must name a heading there.
A headline that rounds, widens or outlives its measurement fails here.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Tuple

from conftest import REPO

HEADLINE_HEADING = "## Headline results"
ROW = re.compile(r"^\|\s*\[(?P<claim>[^\]]+)\]\((?P<doc>[^)#]+)#(?P<anchor>[^)]+)\)\s*\|(?P<figure>.*)\|\s*$")
# a number: digits with an optional decimal part, not inside a longer number
NUMBER = re.compile(r"(?<![\d.])\d+(?:\.\d+)?(?!\.?\d)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def sections(markdown: str) -> Dict[str, str]:
    """{anchor: the heading's text up to the next heading of the same or a higher level}."""
    lines = markdown.splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := HEADING.match(line))]
    out = {}
    for n, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[n + 1:] if lv <= level), len(lines))
        out.setdefault(slug(title), "\n".join(lines[i:end]))
    return out


def headline_rows(readme: str) -> List[Tuple[int, dict]]:
    lines = readme.splitlines()
    start = lines.index(HEADLINE_HEADING)
    rows = []
    for n, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#"):
            break
        m = ROW.match(line)
        if m:
            rows.append((n, m.groupdict()))
    return rows


def numbers(text: str) -> List[str]:
    return NUMBER.findall(text)


def problems(readme: str, read_doc) -> List[str]:
    """One line per headline number missing from its linked section."""
    rows = headline_rows(readme)
    if not rows:
        return [f"README.md: no linked rows under {HEADLINE_HEADING!r}"]
    out = []
    for line, row in rows:
        where = f"README.md:{line} ({row['claim']})"
        section = sections(read_doc(row["doc"])).get(row["anchor"])
        if section is None:
            out.append(f"{where}: {row['doc']} has no heading with anchor #{row['anchor']}")
            continue
        present = set(numbers(section))
        missing = [x for x in numbers(row["claim"] + " " + row["figure"]) if x not in present]
        if missing:
            out.append(f"{where}: {', '.join(dict.fromkeys(missing))} not in "
                       f"{row['doc']}#{row['anchor']}")
    return out


def _read(relpath: str) -> str:
    with open(os.path.join(REPO, relpath), encoding="utf-8") as f:
        return f.read()


def test_every_headline_figure_is_in_the_section_it_links_to():
    found = problems(_read("README.md"), _read)
    assert not found, "README headline figures without a source:\n" + "\n".join(found)


def test_the_check_catches_a_figure_its_section_lacks():
    doc = "# Benchmarks\n\n## Lost NIC\n\n| run | ratio |\n|---|---|\n| a | 0.752, 0.772 |\n\n## Other\n\n0.80\n"
    readme = (f"{HEADLINE_HEADING}\n\n| claim | figure |\n|---|---|\n"
              "| [A lost NIC, 1 of 4](d.md#lost-nic) | 0.752–0.772 of fault-free |\n"
              "| [Rounded](d.md#lost-nic) | 0.75–0.8, found in 2.4 s |\n"
              "| [Gone](d.md#no-such-section) | 1 |\n\n## Next\n")
    found = problems(readme, lambda path: doc)
    assert len(found) == 3, found
    assert "(A lost NIC, 1 of 4): 1, 4 not in d.md#lost-nic" in found[0]
    assert "0.75, 0.8, 2.4 not in d.md#lost-nic" in found[1]  # 0.80 only in another section
    assert "no heading with anchor #no-such-section" in found[2]
    assert slug("Outages: a host or a pair without any path, and a dead peer process") == \
        "outages-a-host-or-a-pair-without-any-path-and-a-dead-peer-process"
