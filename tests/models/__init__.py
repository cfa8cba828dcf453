"""Tests of the models on the runtime: the toy, transformers, the KV pool, fused and small-M projections, the compiled step, tensor parallelism."""
