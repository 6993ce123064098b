"""mkdocs hook: render the normative spec (``spec/*.md``) inside the docs site.

The guide pages link to the spec as ``../spec/<doc>.md`` so the links also
work when the repository is browsed as files. The site serves the spec under
``spec/``: this hook adds every ``spec/*.md`` as a page there and rewrites
the guide's ``../spec/`` links to match, so ``mkdocs build --strict`` checks
them like any other link.
"""

from __future__ import annotations

import os

from mkdocs.structure.files import File

SPEC_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "spec")


def on_files(files, config):
    spec = os.path.abspath(SPEC_DIR)
    for name in sorted(os.listdir(spec)):
        if name.endswith(".md"):
            files.append(File.generated(config, f"spec/{name}", abs_src_path=os.path.join(spec, name)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith("spec/") or "/" in page.file.src_uri:
        return markdown
    return markdown.replace("](../spec/", "](spec/")
