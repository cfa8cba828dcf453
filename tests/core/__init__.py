"""Tests of the core runtime: the planner, inputs, staging, host rows, the short path, capture and its life, emulated and piecewise graphs."""
