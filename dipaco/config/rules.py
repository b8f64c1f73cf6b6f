"""What every section of the run config shares: the error shape, the closed base model and
the bounds its fields are checked against."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

GiB = 1024**3


def refuse(field: str, value: Any, rule: str) -> PydanticCustomError:
    """The one error shape for a broken rule: `field = value: rule`, with all three in ctx."""
    return PydanticCustomError(
        "config_rule", "{field} = {value}: {rule}", {"field": field, "value": value, "rule": rule}
    )


class Section(BaseModel):
    # Closed (an unknown key is refused, naming it) and finite: no inf or NaN reaches a
    # lease size, an outer step or a JSON column (a fuzzed config found each of these).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


MAX_PATHS = 65536  # a sanity bound: the server queues R units per path per round
# Units the server builds (in one transaction) when it opens a round: paths x replicas.
MAX_UNITS_PER_ROUND = 65536
# Upper bounds of counts, lengths, times, rates and sizes: each far above what
# a run of this project can use, so no real config meets one, and small enough that no
# product the server forms of them (data positions, tokens, bytes) leaves a 64-bit column.
MAX_SEED = 2**31 - 1  # every seed consumer takes it; path seeds add fewer than MAX_PATHS
MAX_ROUNDS = 100_000  # DiLoCo/DiPaCo runs have tens to thousands of outer rounds
MAX_INNER_STEPS = 100_000  # H: the papers use 50..2,000 (DiLoCo arXiv 2311.08105 §3)
MAX_BATCH = 65_536  # sequences per micro-batch or per optimiser step's accumulation
MAX_BYTES = 2**50  # 1 PiB: beyond any device's memory or any run's module store
# Data positions (windows, from the run's start) are stored in 63-bit integer columns.
MAX_DATA_POSITION = 2**62
# Tokens of one unit weight its Δ and add up in a worker's credit (64-bit columns): 2^50
# is a million times a 500-step unit at the papers' batch of 512 x 2,048 tokens.
MAX_UNIT_TOKENS = 2**50
