"""Fresh random seeds for tests, printed so a failure can be replayed."""
from __future__ import annotations

import os
import random

import torch


def seeded_rng(env: str, torch_too: bool = False) -> random.Random:
    """A ``random.Random`` seeded from ``$env`` (replay a failure) or a fresh system seed,
    printed as ``env=seed`` (pytest shows it on failure); ``torch_too`` also seeds torch's
    global generator with it."""
    seed = int(os.environ.get(env, random.SystemRandom().randrange(2**31)))
    print(f"{env}={seed}")
    if torch_too:
        torch.manual_seed(seed)
    return random.Random(seed)
