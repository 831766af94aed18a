"""The questions asked of the engine: one step's breakdown (``predict``, ``breakdown``), its
fit in a budget (``budget``), the largest size that fits (``solver``, ``closed_form``,
``thresholds``), and sweeps and comparisons over many (``scaling``, ``comparison``,
``vectorized``, ``quadratic``).

May import: ``memcalc.errors``, ``engine``, ``impls``, ``config``, ``gpus``, ``names``, ``output``.
"""
