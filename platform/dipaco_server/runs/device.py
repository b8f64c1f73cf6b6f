"""The device the server's own forward passes run on: evaluation (runs.evaluate) and proof of
useful work (rounds.verification.scorer). At 150M a window costs ~2.3 s on two CPU threads
and ~1,000x less on a GPU, so a Celery worker with one uses it, in bf16 autocast, batched.

``DIPACO_SERVER_DEVICE``: "auto" (the default: CUDA where torch sees it, else the CPU),
"cpu", or "cuda" / "cuda:N" (refused at the first task if torch sees no such device). A
separate Celery queue for a GPU worker is the deployer's choice (docs/deploy.md). On the
CPU nothing changes: fp32, the same losses as before.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

SETTING = "DIPACO_SERVER_DEVICE"


def server_device(name: str | None = None) -> torch.device:
    """The configured device (`name` overrides the setting)."""
    name = name if name is not None else getattr(settings, SETTING, "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ImproperlyConfigured(
            f"{SETTING}={name!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ImproperlyConfigured(f"{SETTING}={name!r}: use auto, cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise ImproperlyConfigured(
            f"{SETTING}={name!r} but torch sees {count} CUDA device(s) (torch "
            f"{torch.__version__}); set it to auto or cpu, or install a CUDA build of torch"
        )
    return device


def autocast(device: torch.device) -> AbstractContextManager[Any]:
    """bf16 autocast on a GPU; nothing on the CPU (fp32 there, as the losses always were)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()
