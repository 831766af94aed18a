"""Compiled steps: ``torch.compile`` followed as inductor builds it for the GPU, without one.

A traced model that calls ``torch.compile`` (under ``--compile default``) is compiled by the
real stack: dynamo captures the graph from the trace's meta tensors; AOTAutograd traces the
joint forward and backward on meta, where every kernel's shapes are known; before inductor's
joint-graph passes and its min-cut partitioner run, the graph is moved to the CUDA device
(``graphs.py``), so that the passes, the partitioner and the lowering take the decisions
they take for a GPU; inductor then lowers it and writes its CUDA wrapper for the preset's
compute capability and SM count (``device.py``: the device as inductor and triton ask about
it). Nothing is launched: the triton kernels are not compiled (they allocate nothing), and
the wrapper runs on meta tensors under the trace (``wrapper.py``), so every
``empty_strided_cuda``, ``del`` and reuse, and every fallback kernel (cuBLAS, SDPA's fused
kernels) goes through memcalc's allocator and kernel models as the eager step's ops do.

Modules, in the order the data flows: ``device.py`` (the GPU inductor compiles for),
``graphs.py`` (meta graphs to CUDA ones), ``wrapper.py`` (the generated code, run on meta),
``backend.py`` (the ``torch.compile`` backend joining them), ``live.py`` (the same calls
compiled by torch on a real GPU, for ``validate --backend cuda``), ``session.py`` (what a
trace switches on while it runs, and ``torch.compile`` as the traced code calls it).

May import: ``tracing`` and what it may; not ``validation``, ``plots``, ``cli`` or
``commands``.
"""
