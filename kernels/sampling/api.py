"""The sampler's entry points: one contract, two implementations chosen by device.

* :func:`sample`: one token per row from its processed distribution.
* :func:`sample_with_probs`: the same and the distribution itself (a draft model's q).
* :func:`verify`: rejection sampling of one draft token per row (speculative decoding).

CUDA tensors run the Triton kernels (``triton_path.py``: sorting-free, a few launches,
capturable); CPU tensors run the torch path (``torch_path.py``, which also serves
graphs="emulate"). ``use_kernel=True`` forces the kernels (on a CPU only under
``TRITON_INTERPRET=1``, as the tests do), ``False`` the torch path (on CUDA too: capturable,
but it sorts). Both give the same tokens (see ``torch_path.py`` for the rounding caveat).

Every entry point is a function of tensors with static shapes: no host sync, no
``.item()``, outputs of fixed shape (``out=`` to write into static buffers), so a step
that calls it can be captured, and it can be wrapped as an opaque custom op for
torch.compile. Arguments are checked first (``settings.check_sampling_args``, metadata
only; the values too when the settings are CPU tensors): an InputError names the argument
before anything is launched or written.
"""
from __future__ import annotations

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected
from cudagraph_rt.kernels.sampling import launch
from cudagraph_rt.kernels.sampling.launch import SamplingPlan, SamplingWorkspace
from cudagraph_rt.kernels.sampling.philox import Stream
from cudagraph_rt.kernels.sampling.settings import SamplingSettings, check_sampling_args, check_setting_values
from cudagraph_rt.kernels.sampling.torch_path import process, sample_torch, verify_torch

__all__ = ["sample", "sample_with_probs", "uses_kernel", "verify"]


def uses_kernel(logits: Tensor, use_kernel: bool | None = None) -> bool:
    """Whether a call on ``logits`` runs the Triton kernels (see the module doc);
    InputError when ``use_kernel=True`` cannot be honoured here."""
    mode = launch.triton_backend()
    if use_kernel is None:
        return logits.device.type == "cuda" and mode == "compiled"
    if use_kernel and (mode == "unavailable" or (logits.device.type != "cuda" and mode != "interpreter")):
        raise InputError(expected("use_kernel", f"False or None here (triton {mode}, logits on {logits.device})", True))
    return bool(use_kernel)


def _checked(logits, settings, draft, q, tokens, p_draft, validate: bool, probs=None) -> tuple[Tensor, Tensor]:
    """Check the arguments, then return the outputs to write (given, or new)."""
    if validate:
        check_sampling_args(logits, settings, draft, q, tokens, p_draft, probs)
        if all(t.device.type == "cpu" for t in settings.tensors()):
            check_setting_values(settings, logits.shape[1], draft if draft is not None and draft.is_cpu else None)
    n, dev = logits.shape[0], logits.device
    tokens = torch.empty(n, dtype=torch.int64, device=dev) if tokens is None else tokens
    return tokens, torch.empty(n, dtype=torch.float32, device=dev) if p_draft is None else p_draft


def _check_stream(stream) -> int:
    if isinstance(stream, bool) or not isinstance(stream, int) or stream not in (Stream.SAMPLE, Stream.DRAFT):
        raise InputError(expected("stream", "Stream.SAMPLE (a target's token) or Stream.DRAFT (a draft model's)",
                                  repr(stream)))
    return int(stream)


def _pair(out, names: str) -> tuple:
    """``out`` as the pair of output tensors it must be (None: none given)."""
    if out is None:
        return None, None
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError(expected("out", f"None or a ({names}) pair of tensors", type(out).__name__))
    return tuple(out)


def _check_launch_args(plan, workspace) -> None:
    if plan is not None and not isinstance(plan, SamplingPlan):
        raise InputError(expected("plan", "None or a SamplingPlan", type(plan).__name__))
    if workspace is not None and not isinstance(workspace, SamplingWorkspace):
        raise InputError(expected("workspace", "None or a SamplingWorkspace", type(workspace).__name__))


def sample(logits: Tensor, settings: SamplingSettings, *, stream: int = Stream.SAMPLE, out: Tensor | None = None,
           plan: SamplingPlan | None = None, workspace: SamplingWorkspace | None = None,
           use_kernel: bool | None = None, validate: bool = True) -> Tensor:
    """[N] int64: each row's token from softmax(logits / T) after top-k, top-p and min-p
    (``settings.py``), drawn with the randomness of (seed, position, ``stream``); greedy
    rows give ``greedy_tokens``' token. ``out``: an [N] int64 tensor to write (returned).
    ``plan`` / ``workspace``: the kernels' (``launch.py``); ignored by the torch path."""
    stream = _check_stream(stream)
    _check_launch_args(plan, workspace)
    tokens, p_draft = _checked(logits, settings, None, None, out, None, validate)
    if not uses_kernel(logits, use_kernel):
        return tokens.copy_(sample_torch(logits, settings, stream))
    launch.launch_sampler(logits, settings, tokens, p_draft, stream=stream, plan=plan, workspace=workspace)
    return tokens


def sample_with_probs(logits: Tensor, settings: SamplingSettings, *, stream: int = Stream.DRAFT,
                      out: tuple[Tensor, Tensor] | None = None, plan: SamplingPlan | None = None,
                      workspace: SamplingWorkspace | None = None, use_kernel: bool | None = None,
                      validate: bool = True) -> tuple[Tensor, Tensor]:
    """(tokens [N] int64, probs [N, V] float32): :func:`sample` (with the draft stream by
    default: a draft model drafting a position) and the distribution it drew from (p on
    the kept set, 0 elsewhere, one-hot for greedy rows): the q that :func:`verify` takes."""
    stream = _check_stream(stream)
    _check_launch_args(plan, workspace)
    tokens, probs = _pair(out, "tokens, probs")
    tokens, _ = _checked(logits, settings, None, None, tokens, None, validate, probs)
    probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device) if probs is None else probs
    if not uses_kernel(logits, use_kernel):
        tokens.copy_(sample_torch(logits, settings, stream))
        return tokens, probs.copy_(process(logits, settings).probs())
    p_draft = torch.empty(tokens.shape, dtype=torch.float32, device=tokens.device)
    launch.launch_sampler(logits, settings, tokens, p_draft, probs=probs, stream=stream, plan=plan,
                          workspace=workspace)
    return tokens, probs


def verify(logits: Tensor, settings: SamplingSettings, draft: Tensor, *, q: Tensor | None = None,
           out: tuple[Tensor, Tensor] | None = None, plan: SamplingPlan | None = None,
           workspace: SamplingWorkspace | None = None, use_kernel: bool | None = None,
           validate: bool = True) -> tuple[Tensor, Tensor]:
    """Rejection sampling on the device (Leviathan et al. 2023; Chen et al. 2023). Row i
    holds the target's logits for the next token of its sequence, and ``draft[i]`` the token
    the drafter proposed there (-1: none, the bonus row; a value outside [0, V) counts as
    none on the device). ``settings.position`` names that token's position. With p the
    row's processed distribution and q one-hot at the draft (``q=None``: a deterministic
    drafter) or the row of ``q`` [N, V] (a sampling draft model's distribution): accept
    the draft with probability min(1, p(d) / q(d)) (the acceptance stream's uniform),
    else draw from norm(max(0, p - q)) (the residual stream); a row without a draft draws
    from p (the sample stream). Greedy rows reduce to greedy verify: their token is the
    first maximal logit.

    Returns (tokens [N] int64, p(d) [N] float32; 0 without a draft). A token equals its
    draft exactly when the draft was accepted, so ``models.accept.greedy_accept`` decides
    the committed rows from ``tokens != next_tokens`` unchanged."""
    _check_launch_args(plan, workspace)
    tokens, p_draft = _checked(logits, settings, draft, q, *_pair(out, "tokens, p_draft"), validate)
    if not uses_kernel(logits, use_kernel):
        t, p, _ = verify_torch(logits, settings, draft, q)
        return tokens.copy_(t), p_draft.copy_(p)
    launch.launch_sampler(logits, settings, tokens, p_draft, draft=draft, q=q, plan=plan, workspace=workspace)
    return tokens, p_draft
