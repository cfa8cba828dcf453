"""Tests of the tools and the repository: the CLI, bench, sweep, inspect, entry points, packaging, the README, the code's structure."""
