"""Output: how results show themselves (``result``: the protocol; ``render``: rich, HTML,
Markdown, CSV, JSON; ``results``: a breakdown's tables; ``legend``, ``repeats``) and the
progress of long commands on a terminal (``progress``).

May import: ``memcalc.errors``, ``engine``, ``impls``, ``config``, ``gpus``, ``names``.
Never an analysis: results hand themselves to it.
"""
