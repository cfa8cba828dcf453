"""Tests of the Triton kernels: cell attention, row gather, small-M linear."""
