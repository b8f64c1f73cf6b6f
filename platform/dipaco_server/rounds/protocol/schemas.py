"""The worker protocol's wire shapes: what each /api/v1/worker route takes and answers.

The routes are rounds.protocol.api's; these classes are the OpenAPI schema workers were
built against (tests/test_openapi_schema.py holds it), so they change only with the
protocol.
"""

from datetime import datetime
from typing import Annotated, Any

from ninja import Field, Header, Schema

from dipaco_server.bounds import JsonId
from dipaco_server.patterns import NAME, OPTIONAL_NAME, declared
from dipaco_server.rounds.protocol.worker_metrics import WorkerMetricsIn
from dipaco_server.workers.services import MAX_NAME_LENGTH, MAX_OWNER_LENGTH

MAX_MODULES_PER_PATH = 256
SECRET_HEADER = "X-Lease-Secret"
Secret = Annotated[
    str, Header(alias=SECRET_HEADER, max_length=256, description="The lease's secret.")
]
OptionalSecret = Annotated[
    str | None, Header(None, alias=SECRET_HEADER, max_length=256, description="With lease_id.")
]


class DataWindowOut(Schema):
    """Which windows of its path's train shard the unit trains on (dipaco.data.windows)."""

    start_position: int = Field(
        description="Where the unit starts in the path's window order: (t·R + r)·H·B."
    )
    windows: int = Field(description="Windows (sequences of seq_len + 1 tokens) it reads: H·B.")
    seed: int = Field(description="Seed of the path's window order (config.seed + path).")
    dtype: str = Field(description="numpy dtype of the token file, e.g. '<u2' (little-endian).")


class RebaseOut(Schema):
    """outer.overlap eager (rounds.protocol.rebase): after step `at_step`, rebase onto the versions
    round `round`'s outer step publishes (GET .../lease/{lease_id}/rebase)."""

    at_step: int = Field(
        description="Rebase after this many of the unit's inner steps (counted from the "
        "unit's start): ceil(outer.eager_at x H). Wait there until the versions are published."
    )
    round: int = Field(description="The round whose outer step publishes them (lease round - 1).")


class LeaseOut(Schema):
    lease_id: int
    lease_secret: str = Field(description="Send it as X-Lease-Secret. Shown once.")
    attempt: int
    deadline: datetime = Field(description="Heartbeat before this, or the lease expires.")
    hard_deadline: datetime = Field(description="Heartbeats never extend past this.")
    heartbeat_interval_s: float
    run_id: int
    run_name: str
    round: int = Field(description="Outer round t.")
    unit_id: int
    replica: int
    cold: bool = Field(
        default=False,
        description="Train from fresh AdamW moments, not the path's warm ones: every unit "
        "another worker trains too (two copies compare only when both start alike) and, "
        "with DIPACO_COLD_SHARE, others, so that it need not say which units are compared.",
    )
    path: int = Field(description="The path index.")
    modules: list[str] = Field(description="Module ids of the path, in assembly order.")
    base_versions: dict[str, int] = Field(description="Module version each module starts from.")
    steps: int = Field(
        description="The unit's length, the inner loop's bound: inner steps to train, "
        "counted from the unit's start (a resumed checkpoint's included). H "
        "(config.inner.steps), or fewer when the unit is sized to this worker's speed: H "
        "stays the unit's slot of the lr schedule (steps t·H .. t·H + H - 1 of T·H), of "
        "which it trains the first `steps`."
    )
    size_reason: str = Field(description="Why `steps` (speed x units.target_seconds, ...).")
    seconds_limit: float | None = Field(
        description="Stop training after this long and upload the steps done (a new "
        "worker's calibration unit); null: train `steps` steps."
    )
    round_deadline: datetime | None = Field(
        description="The round may close soon after this: upload what is trained by then."
    )
    codec: str = Field(description="How to encode each module's Δ (dipaco.codecs).")
    config: dict[str, Any] = Field(description="The whole run config (dipaco.config.RunConfig).")
    data: DataWindowOut
    rebase: RebaseOut | None = Field(
        None,
        description="outer.overlap eager: when and onto what to rebase (rounds.protocol.rebase); "
        "null: the Δ is relative to base_versions.",
    )


class ModuleUpdateOut(Schema):
    """One encoded outer update (comm.download_codec): version `from_version` + its decoded
    values = version `version`, bit for bit (dipaco.updates.apply_update)."""

    from_version: int
    version: int
    key: str
    url: str = Field(description="Presigned GET of the update (a dipaco.codecs container).")
    sha256: str = Field(description="Of the update's bytes, lowercase hex.")
    size: int = Field(description="Bytes.")
    from_sha256: str = Field(description="sha256 of version from_version's fp32 module file.")
    to_sha256: str = Field(
        description="sha256 of version `version`'s fp32 module file, as the worker rewrites "
        "it (dipaco.modules_file): how it checks the result."
    )


class UnitModuleBlobOut(Schema):
    module_id: str
    version: int
    key: str
    sha256: str
    size: int
    url: str = Field(description="Presigned GET of the module's fp32 weights.")
    updates: list[ModuleUpdateOut] = Field(
        default_factory=list,
        description="The encoded updates from the version the request said it `held` to "
        "`version`, in order: fetch these instead of the fp32 weights (rounds.protocol.downloads). "
        "Empty: fetch the fp32 weights (or keep them, when held at `version`).",
    )


class RowChunkOut(Schema):
    chunk: int = Field(description="The chunk's number in its path's row index.")
    key: str
    url: str = Field(description="Presigned GET of the whole chunk: `rows` rows of seq_len + 1 "
                     "tokens (dipaco.data.rows).")  # fmt: skip
    sha256: str = Field(description="Of the chunk's bytes, lowercase hex: check before use.")
    size: int = Field(description="Bytes.")
    rows: int = Field(description="Rows the chunk holds.")
    start: int = Field(description="The first of the unit's rows in the chunk's order.")
    count: int = Field(description="How many of the unit's rows, in order, from `start`.")
    perm_seed: int | None = Field(
        description="None: the chunk's rows in their own order; else the order of a later "
        "pass over the path, dipaco.data.rows.Segment.rows (a seeded permutation numpy "
        "computes the same everywhere)."
    )


class DataBlobOut(Schema):
    format: str = Field(description="dipaco.data.rows.FORMAT.")
    dtype: str
    seq_len: int
    first_position: int = Field(description="The position of the unit's first row.")
    windows: int = Field(description="Rows the unit reads: its chunks' segments in order.")
    tokens: int
    expires_in_s: int = Field(description="How long the chunk URLs last: the lease's life.")
    chunks: list[RowChunkOut]


class UnitManifestOut(Schema):
    lease_id: int
    expires_in_s: int
    modules: list[UnitModuleBlobOut]
    data: DataBlobOut


class RebaseManifestOut(Schema):
    """The versions an eager unit rebases onto (rounds.protocol.rebase), once they are published."""

    lease_id: int
    state: str = Field(
        description='"ready": `versions` are published and `modules` fetch them; "waiting": '
        "round `round`'s outer step is still running, ask again after `retry_after_s`; "
        '"none": this unit has no rebase (its Δ stays relative to its base versions).'
    )
    round: int | None = Field(description="The round whose outer step publishes them.")
    versions: dict[str, int] = Field(
        description="Module id -> the version to rebase onto (when ready)."
    )
    retry_after_s: float = Field(description="When waiting: ask again after this long.")
    expires_in_s: int
    modules: list[UnitModuleBlobOut] = Field(
        description="When ready: the modules at `versions`, with the encoded updates from "
        "the unit's base versions where the run publishes them (as the manifest's)."
    )


class PresignedPostOut(Schema):
    url: str
    fields: dict[str, str] = Field(description="Form fields to send before the 'file' field.")


class UploadOut(Schema):
    module_id: str
    key: str
    max_bytes: int
    put_url: str | None = Field(
        description="A raw PUT, only where the store itself bounds its size (the local "
        "store); S3 cannot, so use `post` (content-length-range) there."
    )
    post: PresignedPostOut


class UploadUrlsOut(Schema):
    lease_id: int
    codec: str
    expires_in_s: int
    uploads: list[UploadOut]


class ContributionIn(Schema):
    module_id: str = Field(max_length=32)
    sha256: str = Field(max_length=64, description="Of the uploaded bytes, lowercase hex.")
    size: JsonId = Field(description="Bytes uploaded.")


class CompleteIn(Schema):
    contributions: list[ContributionIn] = Field(max_length=MAX_MODULES_PER_PATH)
    tokens: JsonId = Field(description="Training tokens the unit consumed.")
    metrics: WorkerMetricsIn = Field(
        default_factory=WorkerMetricsIn,
        description="The worker's own training metrics (closed: another name, or one of "
        "the server's evaluation series such as val_loss, is refused with 422).",
    )
    base_versions: dict[str, JsonId] | None = Field(
        None,
        max_length=MAX_MODULES_PER_PATH,
        description="Module id -> the version each Δ is relative to: the unit's base "
        "versions (the default), or, for an eager unit that rebased, the versions its "
        "rebase named (outer.overlap eager). Anything else is refused (422).",
    )


class ContributionOut(Schema):
    module_id: str
    key: str
    size: int
    sha256: str
    status: str
    base_version: int | None = Field(
        None, description="The module version the Δ is relative to (rounds.protocol.rebase)."
    )


class CompleteOut(Schema):
    lease_id: int
    state: str
    contributions: list[ContributionOut]


class LeaseStateOut(Schema):
    lease_id: int
    state: str
    deadline: datetime
    hard_deadline: datetime
    round_deadline: datetime | None = Field(
        None,
        description="On heartbeats: the round's deadline now (a quorum may move it up); "
        "stop before it and upload the steps trained.",
    )


class HeartbeatIn(Schema):
    lease_id: JsonId | None = Field(None, description="The lease to extend (with X-Lease-Secret).")


class HeartbeatOut(Schema):
    server_time: datetime
    worker_id: int
    heartbeat_interval_s: float
    lease: LeaseStateOut | None
    instructions: list[str] = Field(
        description="'release': the lease's work is no longer needed; release it and stop."
    )


class RegisterIn(Schema):
    enrollment_token: str = Field(max_length=256, description="From the operator (dpe_...).")
    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        json_schema_extra=declared(NAME),
        description="This machine's name, shown on the dashboard: not only spaces, and no "
        "control or format characters (spaces at either end are dropped).",
    )
    owner: str = Field(
        "",
        max_length=MAX_OWNER_LENGTH,
        json_schema_extra=declared(OPTIONAL_NAME),
        description="Who runs it (optional); no control or format characters.",
    )
    device: dict[str, Any] = Field(
        default_factory=dict, description='What it trains on, e.g. {"gpu": "RTX 4090"}.'
    )


class RegisterOut(Schema):
    worker_id: int
    name: str
    token: str = Field(description="This worker's bearer token. Shown once: keep it.")
    heartbeat_interval_s: float
