"""What a family's ``shared`` step (``ejgen.render.Family.shared``) needs of every family alike: the header of a file
several ops share, and the rule that such a file is rendered from each sharing spec's own context and must come out
the same (docs/DESIGN.md §5, shared folders)."""

from __future__ import annotations

import hashlib


def header(commons: list[dict]) -> dict:
    """The header context of a shared file: the package's folder as its spec path and one hash of the sharing specs'
    hashes (a spec that changes changes the shared file's header)."""
    return {"spec_path": commons[0]["spec_path"].split("/")[0] + "/",
            "spec_hash": hashlib.sha256("".join(c["spec_hash"] for c in commons).encode()).hexdigest()}


def rendered_once(texts: dict[str, str], what: str, template: str, since: str, reads: str, where: str) -> str:
    """The one text every sharing spec rendered (``texts``: spec name -> its render of ``template``); a spec whose
    render differs fails the build, naming ``what`` and why the specs were thought to share (``since``): the template
    reads more of a spec than ``reads``, and ``where`` decides what shares."""
    (first, text), *rest = texts.items()
    differ = [name for name, other in rest if other != text]
    if differ:
        raise AssertionError(f"the {what} of {first} and {', '.join(differ)} differ though {since}: {template} reads "
                             f"more of a spec than {reads}; share only what renders the same ({where})")
    return text
