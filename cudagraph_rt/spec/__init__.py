"""The speculative-decoding wing: a host runner on top of GraphRuntime's public API.

- ``runner``: ``SpecRunner`` and ``Request`` (copy it: the loop an engine wraps around a
  runtime); re-exports the drafters and the run's timing below: import from here.
- ``drafting``: the drafter protocol (``CommittedRows``), controlled drafts, host drafters.
- ``device_drafter``: ``DeviceDrafter``, a draft model in its own GraphRuntime and stream.
- ``run_timing``: a run's host phases, device time from events, ``RunReport``.

The core imports nothing from here; this file imports nothing, so each module costs
only what it uses.
"""
