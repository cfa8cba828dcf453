"""The speculative-decoding wing: a host runner on top of GraphRuntime's public API.

- ``runner``: ``SpecRunner`` and ``Request`` (copy it: the loop an engine wraps around a
  runtime); re-exports the drafters and the run's timing below: import from here.
- ``drafting``: the drafter protocol (``CommittedRows``), and the coin drafters (test doubles:
  right with a chosen probability).
- ``device_drafter``: ``DeviceDrafter``, a draft model in its own GraphRuntime and stream.
- ``run_timing``: a run's host phases, device time from events, ``RunReport``.
- ``proposal``: ``Proposal``, what ``propose`` returns (tokens, and q for a sampled drafter).
- ``ngram``: ``NgramDrafter``, prompt lookup over the sequence's own tokens.
- ``target_parts``: the target's embedding and readout a drafter borrows.
- ``head``, ``head_drafter``: an EAGLE-style draft head, its file format, ``HeadDrafter``.
- ``training``: self-distillation data from the target's own generations; head training
  (``cgrt train-drafter``).

The core imports nothing from here; this file imports nothing, so each module costs
only what it uses.
"""
