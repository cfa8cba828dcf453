"""Tests of the speculative-decoding runner, its drafters and `cgrt demo`."""
