"""The device of the server's own forward passes (runs.device): CUDA where the Celery worker
has it (bf16 autocast), the CPU otherwise (fp32, the losses as before), and a clear refusal
of a device that is not there."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from django.core.exceptions import ImproperlyConfigured

from dipaco_server.runs.device import autocast, server_device


def test_auto_takes_cuda_where_torch_sees_it_and_the_cpu_otherwise(settings: Any) -> None:
    settings.DIPACO_SERVER_DEVICE = "auto"
    assert server_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    settings.DIPACO_SERVER_DEVICE = "cpu"
    assert server_device() == torch.device("cpu")
    assert isinstance(autocast(torch.device("cpu")), nullcontext), "fp32 on the CPU"


@pytest.mark.parametrize(
    ("name", "message"),
    [("banana", "not a device"), ("meta", "use auto, cpu, cuda"), ("cuda:63", "torch sees")],
)
def test_a_device_that_is_not_there_is_refused_naming_the_fix(
    settings: Any, name: str, message: str
) -> None:
    settings.DIPACO_SERVER_DEVICE = name
    with pytest.raises(ImproperlyConfigured, match=message):
        server_device()
