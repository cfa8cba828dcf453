"""The dispatcher on the device (issue 38): speculative rounds run as one launch.

A WHILE over rounds whose body plans the round on the device (:mod:`.planner`: rows,
positions, cells and the width, as the host runner would), SWITCHes to that width's
captured graph, and commits what the verify accepted (:mod:`.commit`) into a ring the host
reads after the launch. ``graphs="emulate"`` runs exactly these semantics eagerly, on the
same static buffers (:mod:`.rounds`); on CUDA the outer graph is built with cuda.bindings
(:mod:`.conditional`), where the driver, the bindings and torch allow it (:mod:`.support`).
"""
