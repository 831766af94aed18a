"""The engine: sizes (``dims``, ``symbolic``, ``forms``, ``units``), the caching allocator,
the program a step runs (``program``, ``inputs``), its replay (``replay``, ``recorder``) and
what it reports (``component``), with the guards on its work (``deadline``, ``work``, ``status``).

May import: ``memcalc.errors`` only. Knows nothing of configurations or implementations.
"""
