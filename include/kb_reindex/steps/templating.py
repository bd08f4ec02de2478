"""The package's Jinja2 templates (`templates/*.html.j2`): the validation report and the Knowledge index page.

A module of its own so the page's server does not import pandas to render one template."""

from __future__ import annotations

from functools import cache

import jinja2


@cache
def templates() -> jinja2.Environment:
    """HTML-escaped by default (a value shown raw must be marked safe in Python, as pandas' own escaped tables
    are), and a missing value is an error rather than an empty string."""
    return jinja2.Environment(loader=jinja2.PackageLoader("kb_reindex", "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined)
