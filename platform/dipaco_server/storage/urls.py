"""Mounted by the project at ``blobs/``: one URL per key, its method picks the action."""

from django.urls import path

from . import views

app_name = "dipaco_blobs"

urlpatterns = [
    path("<path:key>", views.blob, name="blob"),
    # No key at all: answer with the same JSON error as a bad key, not an HTML 404.
    path("", views.blob, {"key": ""}),
]
