"""One writer of generated blocks for every page: between the markers, in place of a
placeholder, as a new page, and never anywhere it would have to guess."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.docblock import replace_block

B, E = "<!-- b -->", "<!-- e -->"


def test_the_text_between_the_markers_is_replaced_and_the_rest_kept(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text(f"# p\n\n{B}\nold\n{E}\n\nhand-written\n")
    replace_block(page, B, E, f"{B}\nnew\n{E}")
    assert page.read_text() == f"# p\n\n{B}\nnew\n{E}\n\nhand-written\n"


def test_a_placeholder_a_new_page_and_a_page_without_either(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("# p\n\nPLACE\n")
    replace_block(page, B, E, f"{B}\nx\n{E}", placeholder="PLACE")
    assert page.read_text() == f"# p\n\n{B}\nx\n{E}\n"
    new = tmp_path / "sub" / "n.md"
    replace_block(new, B, E, f"{B}\ny\n{E}", title="New")
    assert new.read_text() == f"# New\n\n{B}\ny\n{E}\n"
    bare = tmp_path / "bare.md"
    bare.write_text("# bare\n")
    with pytest.raises(SystemExit):
        replace_block(bare, B, E, f"{B}\nz\n{E}")
    assert bare.read_text() == "# bare\n"
