"""The staff forms' fields and checks: datasets (a path under a data root, or an uploaded
JSONL file) and enrollment tokens. The run form is dipaco_web.runform (its fields come
from the run config schema)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from django import forms
from django.conf import settings

from dipaco_server.runs.sources import data_roots

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
DEFAULT_UPLOAD_MAX_BYTES = 64 * 1024 * 1024
MAX_EXPIRY_HOURS = 365 * 24


def upload_max_bytes() -> int:
    """The largest JSONL upload accepted (settings.DIPACO_DATASET_UPLOAD_MAX_BYTES)."""
    return int(getattr(settings, "DIPACO_DATASET_UPLOAD_MAX_BYTES", DEFAULT_UPLOAD_MAX_BYTES))


def upload_dir() -> Path:
    """Uploaded corpora go under the first data root, so their source passes its check."""
    return data_roots()[0] / "uploads"  # runs.sources: DIPACO_DATA_ROOTS


class DatasetForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Letters, digits, '.', '_' or '-'.")
    kind = forms.ChoiceField(
        choices=[("path", "A corpus on the server"), ("upload", "Upload a JSONL file")],
        initial="path",
        widget=forms.RadioSelect,
    )
    source = forms.CharField(
        max_length=1000,
        required=False,
        help_text='"stdlib", or an absolute path to a directory of text or a .jsonl file '
        "under a data root.",
    )
    file = forms.FileField(required=False, help_text="One JSON object per line, e.g. "
                           '{"text": "..."}.')  # fmt: skip
    text_field = forms.CharField(max_length=64, initial="text", required=False)

    def clean_name(self) -> str:
        name = str(self.cleaned_data["name"]).strip()
        if not NAME.match(name):
            raise forms.ValidationError(
                "use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return name

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        kind = data.get("kind")
        if kind == "path" and not str(data.get("source") or "").strip():
            self.add_error("source", 'give "stdlib" or an absolute path on the server')
        if kind == "upload":
            upload = data.get("file")
            if upload is None:
                self.add_error("file", "choose a .jsonl file to upload")
            elif upload.size > upload_max_bytes():
                self.add_error(
                    "file",
                    f"the file is {upload.size:,} bytes; the limit is {upload_max_bytes():,}: "
                    "upload a sample, or put the corpus "
                    "under a data root and name its path",
                )
        return data


def check_jsonl(path: Path, text_field: str) -> tuple[int, int]:
    """(documents, characters) of an uploaded JSONL file, or ValueError naming the first bad
    line. Untrusted bytes: only parsed as UTF-8 JSON, one object per line."""
    documents = chars = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise ValueError(f"line {number} is not UTF-8 JSON ({exc})") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ValueError(
                    f"line {number} has no string field {text_field!r}; each line must be an "
                    f'object like {{"{text_field}": "..."}}'
                )
            documents += 1
            chars += len(record[text_field])
    if documents == 0:
        raise ValueError("the file holds no documents")
    return documents, chars


class EnrollmentForm(forms.Form):
    label = forms.CharField(max_length=100, required=False, help_text="Who or what it is for.")
    max_uses = forms.IntegerField(
        min_value=1, max_value=2**31 - 1, required=False, initial=1,
        help_text="Workers it may register; empty: unlimited.",
    )  # fmt: skip
    expires_in_hours = forms.IntegerField(
        min_value=1, max_value=MAX_EXPIRY_HOURS, required=False, initial=24 * 7,
        help_text="Hours until it expires; empty: never.",
    )  # fmt: skip
