"""Sampling inside the step: per-row temperature, top-k, top-p, min-p and a seed, with
counter-based randomness, and rejection sampling for speculative verification.

The modules, one idea each:

* ``settings``: :class:`SamplingSettings` (the six per-row tensors), what each setting
  means, and the checks (:func:`check_sampling_args`, metadata only;
  :func:`check_setting_values`, the values of host rows).
* ``philox``: the randomness (Philox4x32-10 keyed by seed, countered by position, stream
  and vocabulary index), the same bits in torch and Triton; :class:`Stream`.
* ``api``: :func:`sample`, :func:`sample_with_probs`, :func:`verify`, dispatched by device.
* ``torch_path``: the contract in torch ops (the CPU path, the kernels' oracle).
* ``triton_path``, ``search_kernels`` (the threshold search) and ``launch``: the
  sorting-free kernels, their plan and workspace.
* ``reference``: sort-based sampling as torch users and vLLM write it (the tests'
  distribution oracle, the benchmark's baseline).
* ``bench``: ``python -m cudagraph_rt.kernels.sampling.bench`` (``--smoke`` on a CPU).
"""
from cudagraph_rt.kernels.sampling.api import sample, sample_with_probs, uses_kernel, verify
from cudagraph_rt.kernels.sampling.launch import SamplingPlan, SamplingWorkspace, plan_sampling
from cudagraph_rt.kernels.sampling.philox import Stream
from cudagraph_rt.kernels.sampling.settings import (MIN_TEMPERATURE, SamplingSettings, check_sampling_args,
                                                    check_setting_values)

__all__ = ["MIN_TEMPERATURE", "SamplingPlan", "SamplingSettings", "SamplingWorkspace", "Stream",
           "check_sampling_args", "check_setting_values", "plan_sampling", "sample",
           "sample_with_probs", "uses_kernel", "verify"]
