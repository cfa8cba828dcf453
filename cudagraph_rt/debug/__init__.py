"""The diagnostics wing: why a step will not capture and what a captured graph holds.

- ``hazards``: the capture-hazard finder (host syncs, CPU tensors baked in, RNG, ...);
  the core's ``GraphRuntime.explain_capture`` runs it when a capture fails.
- ``graph_nodes``: a captured graph's nodes read through cuda.bindings (the [gpu] extra).
- ``inspect``: ``inspect_runtime`` (per-width graph contents, replay time, graphs on vs
  off) and the whole surface of the two above, re-exported: import from here.

Nothing in this package is imported by the core at import time, and this file imports
nothing, so ``from cudagraph_rt.debug.hazards import ...`` costs the hazard finder only.
"""
